//! The control socket's reply as the CLI reads it: one JSON line `{"stdout": "...", "stderr":
//! "...", "code": N}` from the process listening on `POOL/control.sock`.
//!
//! That process has passed the peer check of `control::ask` (it runs as the pool directory's
//! owner or as root), yet its bytes are read as hostile all the same:
//! - the line is read up to a limit ([`MAX_REPLY`]) and never further: a reply that does not
//!   end within it is an error, not memory;
//! - fields other than the three are skipped without being kept (`serde`'s default for a
//!   struct: no amplification by a reply of many small values);
//! - the exit status must be one a process can have (0..=255; `exit(256)` would be a success);
//! - the text comes back printable ([`printable`]): control characters (C0, DEL, C1) other than
//!   newline and tab are removed, in place, so no escape sequence the daemon sends reaches the
//!   terminal. The CLI's own output (progress bars, `top`'s screen) is drawn by the CLI itself,
//!   never passed through here.
//!
//! The fuzz target `control_reply` (fuzz/fuzz_targets/control_reply.rs) runs [`read`] and
//! [`decode`] on arbitrary bytes.

use crate::error::{Context, Result, ServiceError};
use std::io::{BufRead, BufReader, Read};

/// Longest reply read, in bytes. A daemon's reply holds a whole command's output (the
/// largest is a `diff` of a much-written volume: about 34 bytes per extent, so some two
/// million extents); the CLI's memory stays within about three times this while it decodes.
pub const MAX_REPLY: u64 = 64 << 20;

/// What the daemon answered to one request, printable.
#[derive(Debug)]
pub struct Reply {
    pub stdout: String,
    pub stderr: String,
    pub code: i32,
}

/// The reply as it arrives.
#[derive(serde::Deserialize)]
struct Wire {
    #[serde(default)]
    stdout: String,
    #[serde(default)]
    stderr: String,
    code: i64,
}

/// Read the reply line from `r`: its bytes up to and with the first newline (or up to the end
/// of the stream), at most `limit` of them. An empty stream gives an empty line.
pub fn read(r: impl Read, limit: u64) -> Result<Vec<u8>> {
    let mut line = Vec::new();
    BufReader::new(r.take(limit))
        .read_until(b'\n', &mut line)
        .context("cannot read the reply")?;
    if line.len() as u64 >= limit && line.last() != Some(&b'\n') {
        return Err(ServiceError::Control(format!(
            "its reply goes on past {limit} bytes, more than a condense daemon ever sends; \
             it was not read further"
        )));
    }
    Ok(line)
}

/// Decode a reply line (as [`read`] returns it, non-empty) into printable text and an exit
/// status.
pub fn decode(line: Vec<u8>) -> Result<Reply> {
    let wire: Wire = serde_json::from_slice(&line).context(
        "its reply is not the JSON line {\"stdout\": \"...\", \"stderr\": \"...\", \"code\": N} a condense daemon sends",
    )?;
    drop(line);
    let code = match i32::try_from(wire.code) {
        Ok(c) if (0..=255).contains(&c) => c,
        _ => {
            return Err(ServiceError::Control(format!(
                "its reply gives the exit status {}, which no process can have (0 to 255)",
                wire.code
            )))
        }
    };
    Ok(Reply {
        stdout: printable(wire.stdout),
        stderr: printable(wire.stderr),
        code,
    })
}

/// `text` without its control characters (C0, DEL, C1), newline and tab excepted.
pub fn printable(mut text: String) -> String {
    text.retain(|c| !c.is_control() || c == '\n' || c == '\t');
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Result;

    #[test]
    fn a_reply_is_read_up_to_its_newline_and_never_past_the_limit() -> Result<()> {
        let line = read(&b"{\"code\":0}\nmore"[..], 100)?;
        assert_eq!(line, b"{\"code\":0}\n");
        assert_eq!(read(&b"{\"code\":0}"[..], 100)?, b"{\"code\":0}");
        assert!(read(&b""[..], 100)?.is_empty());
        // Endless: stops at the limit.
        match read(std::io::repeat(b'x'), 4096) {
            Err(e) => assert!(
                crate::error::chain(&e).contains("past 4096 bytes"),
                "{}",
                crate::error::chain(&e)
            ),
            Ok(line) => panic!("an endless reply read whole: {} bytes", line.len()),
        }
        // A line of exactly the limit, newline included, is whole.
        assert_eq!(read(&b"12345\n"[..], 6)?.len(), 6);
        Ok(())
    }

    #[test]
    fn decoded_text_has_no_control_characters_but_newlines_and_tabs() -> Result<()> {
        let r = decode(
            br#"{"stdout":"\u001b[2J\u001b]0;owned\u0007no damage\r\n\tok\u009b31m","stderr":"\u007f","code":0,"x":[1,2]}"#
                .to_vec(),
        )?;
        assert_eq!(r.stdout, "[2J]0;ownedno damage\n\tok31m");
        assert_eq!(r.stderr, "");
        assert_eq!(r.code, 0);
        Ok(())
    }

    #[test]
    fn an_exit_status_no_process_can_have_is_refused() {
        for code in ["256", "-1", "4294967296", "1.5", "\"0\""] {
            let line = format!("{{\"stdout\":\"\",\"code\":{code}}}").into_bytes();
            assert!(decode(line).is_err(), "{code}");
        }
        assert!(decode(b"{\"stdout\":\"x\"}".to_vec()).is_err());
        assert!(decode(b"{\"code\":0,\"code\":1}".to_vec()).is_err());
        assert_eq!(
            decode(b"{\"code\":3}".to_vec()).map(|r| r.code).ok(),
            Some(3)
        );
    }
}
