//! `condense top` (alias `iostat`): a live per-volume view of the I/O of a served pool.
//!
//! Owns: asking the daemon that holds the pool (`serve`, `mount`) for its per-volume I/O
//! counters once per interval (`condense_service::top`, which also turns two samples into
//! rows); and showing them: a full-screen view on a terminal (busiest volume first; `q`,
//! Ctrl-C, SIGTERM or SIGHUP quits and restores the terminal), one JSON object per interval
//! (`--json`, keys in docs/TOP.md), or one plain line per volume per interval (`--plain`, the
//! default when standard output is not a terminal).

use anyhow::{Context, Result};
use clap::Args;
use condense_service::top::{header, name_width, now_utc, rows, sample, Interval, Row};
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct TopArgs {
    /// One JSON object per interval, for scripts (keys in docs/TOP.md).
    #[arg(long, conflicts_with = "plain")]
    json: bool,
    /// One plain line per volume per interval, no escape codes (for logs; the default when
    /// standard output is not a terminal).
    #[arg(long)]
    plain: bool,
    /// Seconds between reports (0.1 or more).
    #[arg(long, default_value_t = 1.0, value_parser = parse_interval)]
    interval: f64,
    /// Stop after this many reports (default: until q, Ctrl-C or the end of the output).
    #[arg(long)]
    count: Option<u64>,
    /// Also show internal volumes (names starting with '.', such as FUSE file contents).
    #[arg(long)]
    all: bool,
    /// Print the daemon's totals once, as one JSON line (what `top` asks for every interval).
    #[arg(long, hide = true)]
    counters: bool,
}

impl TopArgs {
    /// The request `top` sends the daemon (answered by `condense_service::top::counters`).
    pub fn counters(&self) -> bool {
        self.counters
    }
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!(
            "invalid interval {s:?}: give seconds between 0.1 and 3600, e.g. 1 or 0.5"
        )),
    }
}

pub const LONG_ABOUT: &str = "Show, every second, what each volume of a served pool is doing: \
read and write operations per second and MiB/s, latency percentiles (p50, p99) of reads and \
writes as the Volume API sees them (under NBD and FUSE alike), how much of what was written \
deduplicated and how well new data compressed, and the cache tier's hit ratio for the volume's \
reads. Busiest volume first.\n\n\
It reads the counters of the `condense serve` or `condense mount` process that holds the pool, \
through its control socket (POOL/control.sock); without one it says so. The counters start when \
that process opened the pool.\n\n\
On a terminal: a full-screen view, q or Ctrl-C quits. Otherwise (or with --plain) one line per \
volume per interval, for logs; --json gives one JSON object per interval (docs/TOP.md).";

enum Mode {
    Screen,
    Plain,
    Json,
}

/// `condense top`.
pub fn run(pool: &Path, a: &TopArgs) -> Result<i32> {
    let abs = std::path::absolute(pool)
        .with_context(|| format!("cannot resolve the pool path {}", pool.display()))?;
    let abs_text = abs.to_str().with_context(|| {
        format!(
            "the pool path {} is not valid UTF-8; it cannot be sent to the process holding the pool",
            abs.display()
        )
    })?;
    let argv: Vec<String> = ["--pool", abs_text, "top", "--counters"]
        .map(String::from)
        .to_vec();
    if a.counters {
        let s = sample(&abs, &argv)?;
        println!("{}", serde_json::to_string(&s)?);
        return Ok(0);
    }
    let mode = if a.json {
        Mode::Json
    } else if a.plain || !std::io::stdout().is_terminal() {
        Mode::Plain
    } else {
        Mode::Screen
    };
    let interval = Duration::from_secs_f64(a.interval);
    let mut before = sample(&abs, &argv)?;
    let mut at = Instant::now();
    let screen = match mode {
        Mode::Screen => Some(Screen::enter(&abs, interval)?),
        _ => None,
    };
    let mut out = std::io::stdout().lock();
    let mut reports = 0u64;
    let mut header_shown = false;
    while a.count.is_none_or(|c| reports < c) {
        match &screen {
            Some(s) => {
                if s.quit_within(interval)? {
                    break;
                }
            }
            None => std::thread::sleep(interval),
        }
        let now = sample(&abs, &argv)?;
        let now_at = Instant::now();
        let rows = rows(
            &before,
            &now,
            now_at.duration_since(at).as_secs_f64(),
            a.all,
        );
        let (unix, clock) = now_utc();
        let width = name_width(&rows);
        let shown = match (&mode, &screen) {
            (Mode::Json, _) => {
                let secs = now_at.duration_since(at).as_secs_f64();
                let line = condense_service::render::json_line(&Interval::new(
                    unix, secs, &abs, &rows, &now,
                ))?;
                writeln!(out, "{line}")
            }
            (_, Some(s)) => s.draw(&mut out, &clock, &rows, width, now.releasing_note()),
            _ => {
                let mut text = String::new();
                if !header_shown {
                    text = format!("{:<8} {}\n", "TIME", header(width));
                    header_shown = true;
                }
                for r in &rows {
                    text += &format!("{clock:<8} {}\n", r.line(width));
                }
                if let Some(note) = now.releasing_note() {
                    text += &format!("{clock:<8} {note}\n");
                }
                write!(out, "{text}")
            }
        };
        // A reader that went away (`| head`) ends the command quietly.
        if shown.and_then(|()| out.flush()).is_err() {
            break;
        }
        before = now;
        at = now_at;
        reports += 1;
    }
    Ok(0)
}

/// Set by SIGTERM, SIGHUP or SIGINT while the full-screen view is up: the loop ends and the
/// terminal is restored, where the default action would kill the process with the terminal
/// still in raw mode on the alternate screen.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Catch SIGTERM, SIGHUP and SIGINT into [`STOP`], without `SA_RESTART`, so a `poll` waiting
/// for a key returns at once.
fn catch_stop_signals() {
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        // SAFETY: a zeroed sigaction with a valid handler and an empty mask; the handler only
        // stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

/// The full-screen view: the terminal in its alternate screen, keys read one at a time
/// without echo (Ctrl-C is read as a key too, so quitting always restores the terminal; so
/// do SIGTERM and SIGHUP, see [`STOP`]).
struct Screen {
    title: String,
    /// The terminal's settings before, when standard input is one.
    saved: Option<libc::termios>,
}

impl Screen {
    fn enter(pool: &Path, interval: Duration) -> Result<Screen> {
        catch_stop_signals();
        let mut saved = None;
        if std::io::stdin().is_terminal() {
            // SAFETY: a zeroed termios is a valid out-parameter; fd 0 is a terminal.
            let mut t: libc::termios = unsafe { std::mem::zeroed() };
            if unsafe { libc::tcgetattr(0, &mut t) } == 0 {
                let mut raw = t;
                raw.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG);
                raw.c_cc[libc::VMIN] = 1;
                raw.c_cc[libc::VTIME] = 0;
                // SAFETY: `raw` is a valid termios for fd 0.
                if unsafe { libc::tcsetattr(0, libc::TCSANOW, &raw) } == 0 {
                    saved = Some(t);
                }
            }
        }
        let quit = if saved.is_some() {
            "q quits"
        } else {
            "Ctrl-C quits"
        };
        let screen = Screen {
            title: format!(
                "condense top: pool {}, every {:.1} s, {quit}",
                pool.display(),
                interval.as_secs_f64()
            ),
            saved,
        };
        let mut out = std::io::stdout().lock();
        write!(
            out,
            "\x1b[?1049h\x1b[?25l\x1b[H\x1b[2J{}\r\nwaiting for the first interval...\r\n",
            screen.title
        )?;
        out.flush()?;
        Ok(screen)
    }

    /// Wait `d`; true if q, Q or Ctrl-C was pressed meanwhile, or a stop signal came.
    fn quit_within(&self, d: Duration) -> Result<bool> {
        let until = Instant::now() + d;
        loop {
            if STOP.load(Ordering::Relaxed) {
                return Ok(true);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            if self.saved.is_none() {
                // No terminal to poll: short sleeps, so a signal is seen within 50 ms.
                std::thread::sleep(left.min(Duration::from_millis(50)));
                continue;
            }
            let mut p = libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n <= 0 {
                continue; // the time is up, or a signal (the loop checks both)
            }
            let mut key = [0u8; 16];
            // SAFETY: `key` is valid for writes of its length.
            let got = unsafe { libc::read(0, key.as_mut_ptr().cast(), key.len()) };
            if got == 0 {
                return Ok(true); // the terminal went away
            }
            let got = usize::try_from(got).unwrap_or(0);
            if key[..got].iter().any(|&k| k == b'q' || k == b'Q' || k == 3) {
                return Ok(true);
            }
        }
    }

    fn draw(
        &self,
        out: &mut dyn Write,
        clock: &str,
        rows: &[Row],
        width: usize,
        note: Option<String>,
    ) -> std::io::Result<()> {
        let mut text = format!(
            "\x1b[H\x1b[2J{}  {clock} UTC\r\n\r\n\x1b[7m{}\x1b[0m\r\n",
            self.title,
            header(width)
        );
        for r in rows.iter().map(|r| r.line(width)).chain(note) {
            text += &r;
            text += "\r\n";
        }
        out.write_all(text.as_bytes())
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        let mut out = std::io::stdout().lock();
        let _ = write!(out, "\x1b[?25h\x1b[?1049l");
        let _ = out.flush();
        if let Some(t) = &self.saved {
            // SAFETY: `t` is the terminal's own earlier state.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, t) };
        }
    }
}
