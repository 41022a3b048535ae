//! The FUSE file tree's metadata records (superblock, inode, directory) as the pool returns them.
//! See `condense_fuse::fuzz::records` for what is checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = condense_fuse::fuzz::records(data);
});
