//! A minimal read-only NBD client (fixed newstyle handshake, `NBD_OPT_GO`, simple replies):
//! just enough to read a guest disk that `qemu-nbd -r` exports on a Unix socket.
//! Several reads are kept in flight at once; replies may come back in any order.

use crate::error::{bail, Context, Result};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_BIT: u32 = 1 << 31;
const INFO_EXPORT: u16 = 0;
const CMD_READ: u16 = 0;
const CMD_DISC: u16 = 2;

/// The largest read sent in one request (qemu-nbd accepts up to 32 MiB).
const MAX_REQUEST: usize = 2 << 20;

pub struct NbdClient {
    sock: UnixStream,
    size: u64,
}

fn read_u16(r: &mut impl Read) -> std::io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

impl NbdClient {
    /// Connect to the default export ("") of the server listening on `socket`.
    pub fn connect(socket: &Path) -> Result<NbdClient> {
        let sock = UnixStream::connect(socket)
            .with_context(|| format!("cannot connect to NBD socket {}", socket.display()))?;
        let mut c = NbdClient { sock, size: 0 };
        c.handshake()
            .context("NBD handshake with qemu-nbd failed")?;
        Ok(c)
    }

    fn handshake(&mut self) -> Result<()> {
        let s = &mut self.sock;
        if read_u64(s)? != NBDMAGIC || read_u64(s)? != IHAVEOPT {
            bail!("the server is not a newstyle NBD server");
        }
        let flags = read_u16(s)?;
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            bail!("the server does not speak fixed newstyle NBD");
        }
        let client_flags = u32::from(flags & (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES));
        let mut msg = Vec::new();
        msg.extend_from_slice(&client_flags.to_be_bytes());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&OPT_GO.to_be_bytes());
        // Data: export name length (0), no name, no information requests.
        msg.extend_from_slice(&6u32.to_be_bytes());
        msg.extend_from_slice(&0u32.to_be_bytes());
        msg.extend_from_slice(&0u16.to_be_bytes());
        s.write_all(&msg)?;
        let mut size = None;
        loop {
            if read_u64(s)? != OPT_REPLY_MAGIC {
                bail!("bad option reply magic");
            }
            let _opt = read_u32(s)?;
            let kind = read_u32(s)?;
            let len = read_u32(s)? as usize;
            if len > 1 << 20 {
                bail!("option reply of {len} bytes is too long");
            }
            let mut data = vec![0u8; len];
            s.read_exact(&mut data)?;
            if kind & REP_ERR_BIT != 0 {
                bail!(
                    "the server refused the export (error {kind:#x}): {}",
                    String::from_utf8_lossy(&data)
                );
            }
            match kind {
                REP_INFO
                    if data.len() >= 12
                        && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT =>
                {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&data[2..10]);
                    size = Some(u64::from_be_bytes(b));
                }
                REP_ACK => break,
                _ => {}
            }
        }
        self.size = size.context("the server sent no export size")?;
        Ok(())
    }

    /// Size of the export in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Fill `buf` from `offset`, with up to `buf.len() / 2 MiB` requests in flight.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.size)
            .with_context(|| {
                format!(
                    "read of {} bytes at {offset} is past the end of the disk ({} bytes)",
                    buf.len(),
                    self.size
                )
            })?;
        let pieces: Vec<(usize, usize)> = (0..buf.len())
            .step_by(MAX_REQUEST)
            .map(|s| (s, MAX_REQUEST.min(buf.len() - s)))
            .collect();
        let mut req = Vec::with_capacity(pieces.len() * 28);
        for (handle, &(start, len)) in pieces.iter().enumerate() {
            req.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            req.extend_from_slice(&0u16.to_be_bytes());
            req.extend_from_slice(&CMD_READ.to_be_bytes());
            req.extend_from_slice(&(handle as u64).to_be_bytes());
            req.extend_from_slice(&(offset + start as u64).to_be_bytes());
            req.extend_from_slice(&(len as u32).to_be_bytes());
        }
        self.sock
            .write_all(&req)
            .context("sending NBD read requests")?;
        let mut done = vec![false; pieces.len()];
        for _ in 0..pieces.len() {
            let magic = read_u32(&mut self.sock).context("reading an NBD reply")?;
            if magic != SIMPLE_REPLY_MAGIC {
                bail!("unexpected NBD reply magic {magic:#x}");
            }
            let error = read_u32(&mut self.sock)?;
            let handle = read_u64(&mut self.sock)? as usize;
            let &(start, len) = pieces
                .get(handle)
                .filter(|_| !done[handle])
                .with_context(|| format!("NBD reply with an unknown handle {handle}"))?;
            if error != 0 {
                bail!(
                    "the NBD server failed a read of {len} bytes at offset {} (error {error})",
                    offset + start as u64
                );
            }
            self.sock
                .read_exact(&mut buf[start..start + len])
                .context("reading NBD reply data")?;
            done[handle] = true;
        }
        Ok(())
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let mut req = Vec::with_capacity(28);
        req.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&CMD_DISC.to_be_bytes());
        req.extend_from_slice(&[0u8; 20]);
        let _ = self.sock.write_all(&req);
    }
}
