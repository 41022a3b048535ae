//! Numbers of the NBD protocol (NetworkBlockDevice/nbd `doc/proto.md`), fixed newstyle only.
//!
//! Everything on the wire is big-endian. Names follow the specification with the `NBD_` prefix
//! dropped.

// Handshake.
/// "NBDMAGIC", the first 8 bytes the server sends.
pub const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": second server magic, and the magic of every client option.
pub const OPTS_MAGIC: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const REP_MAGIC: u64 = 0x0003_e889_0455_65a9;

// Handshake flags (server, 16 bits).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;

// Client flags (32 bits).
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;
pub const CLIENT_FLAGS_KNOWN: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

// Transmission flags (16 bits).
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR | 1;
pub const REP_ERR_POLICY: u32 = REP_ERR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

// Information types of NBD_REP_INFO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Size of a request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_HEADER_BYTES: usize = 28;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

// base:allocation flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

// qemu:dirty-bitmap flags (qemu docs/interop/nbd.rst).
/// Set for blocks that changed since the snapshot the bitmap is named after.
pub const STATE_DIRTY: u32 = 1 << 0;

/// The allocation metadata context.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// The id this server gives `base:allocation` when a client selects it.
pub const META_ID_BASE_ALLOCATION: u32 = 1;
/// `qemu:dirty-bitmap:SNAP`, one context per snapshot of a volume.
pub const META_DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// Ids of selected dirty bitmaps count up from here, in the order the client selected them.
pub const META_ID_DIRTY_BITMAP_FIRST: u32 = 2;

// Error values.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Longest string (export name, query, message) the protocol allows.
pub const STRING_BYTES_MAX: usize = 4096;

/// The NBD error value for a POSIX errno (the protocol allows only a few).
pub fn nbd_error_from_errno(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => EPERM,
        libc::ENOMEM => ENOMEM,
        libc::EINVAL => EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ENOSPC,
        libc::EOVERFLOW => EOVERFLOW,
        libc::ENOTSUP => ENOTSUP,
        libc::ESHUTDOWN => ESHUTDOWN,
        _ => EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping_covers_the_volume_errors() {
        assert_eq!(nbd_error_from_errno(30), EPERM); // EROFS: read-only pool
        assert_eq!(nbd_error_from_errno(28), ENOSPC);
        assert_eq!(nbd_error_from_errno(22), EINVAL);
        assert_eq!(nbd_error_from_errno(5), EIO);
        assert_eq!(nbd_error_from_errno(2), EIO); // ENOENT: volume deleted under us
        assert_eq!(nbd_error_from_errno(17), EIO);
    }

    #[test]
    fn magics_spell_their_names() {
        assert_eq!(&INIT_MAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&OPTS_MAGIC.to_be_bytes(), b"IHAVEOPT");
    }
}
