//! `condense volume libvirt-xml`: the libvirt `<disk>` element that attaches a volume, as
//! `condense serve` exports it, to a domain (docs/LIBVIRT.md).
//!
//! Owns the translation of a volume name and an endpoint into domain XML, nothing else: the
//! NBD export is served by `serve`, the XML is used by `virsh define`/`attach-device`.
//! Invariants:
//! - the export name is the volume name exactly as `serve` exports it (`VOLUME`, or
//!   `VOLUME@SNAPSHOT` for a snapshot), and only a name the pool holds and `serve` exports is
//!   written;
//! - every value placed in the XML is escaped, and a value XML cannot carry (a control
//!   character) is refused, so the output is well-formed whatever the name;
//! - a snapshot is always `<readonly/>` (serve refuses writes to it);
//! - a socket path is absolute (libvirt refuses relative ones) and the default is the one
//!   `serve` listens on by default, `POOL/nbd.sock`.

use anyhow::{bail, Context, Result};
use condense_api::Catalog;
use condense_service::control::Ctx;
use std::path::{Path, PathBuf};

/// The NBD port `serve --listen` documents and qemu assumes without one.
const NBD_PORT: u16 = 10809;

#[derive(clap::Args, Debug)]
pub struct LibvirtXmlArgs {
    /// The volume, or VOLUME@SNAPSHOT for one of its snapshots (always read-only).
    pub name: String,
    /// The Unix socket `condense serve` listens on, as an absolute path (the default: the
    /// pool's POOL/nbd.sock, where serve listens without --socket). With `serve --socket PATH
    /// --group libvirt-qemu`, give the same PATH here.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["tls", "insecure_tcp"])]
    pub socket: Option<PathBuf>,
    /// Attach over TCP with TLS to HOST[:PORT] (default port 10809), a `serve --listen` with
    /// --tls-cert and --tls-client-ca. libvirt takes the client certificate from the
    /// directory named by nbd_tls_x509_cert_dir in /etc/libvirt/qemu.conf (ca-cert.pem,
    /// client-cert.pem, client-key.pem; docs/LIBVIRT.md). Write an IPv6 address in brackets.
    #[arg(long, value_name = "HOST[:PORT]", conflicts_with = "insecure_tcp")]
    pub tls: Option<String>,
    /// Attach over plaintext TCP to HOST[:PORT], a `serve --insecure-listen`: anyone on the
    /// network can read and write the volume, so only on a network where that is true.
    #[arg(long, value_name = "HOST[:PORT]")]
    pub insecure_tcp: Option<String>,
    /// The disk's device name in the guest's configuration: vdX (virtio, the fastest), sdX
    /// (SCSI) or hdX (IDE). vda is the first virtio disk, the one a VM usually boots from;
    /// use vdb, vdc... for more disks of one domain.
    #[arg(long, value_name = "DEV", default_value = "vda")]
    pub target: String,
    /// Attach the disk read-only (always so for a snapshot).
    #[arg(long)]
    pub readonly: bool,
}

/// Where the `<source>` element points.
#[derive(Debug, PartialEq, Eq)]
enum Endpoint {
    Unix(PathBuf),
    Tcp { host: String, port: u16, tls: bool },
}

/// `condense volume libvirt-xml NAME ...`: check that the pool exports NAME, print its `<disk>`.
pub fn run(ctx: &mut Ctx, a: &LibvirtXmlArgs) -> Result<()> {
    let endpoint = endpoint(a, &ctx.path)?;
    let bus = bus_of(&a.target)?;
    let pool = ctx.pool(true)?;
    let snapshot = match condense_api::split_snapshot_name(&a.name) {
        Some((volume, snap)) => {
            let snaps = pool.snapshots().context("cannot list snapshots")?;
            if !snaps
                .iter()
                .any(|s| s.volume == volume && s.snapshot == snap)
            {
                bail!(
                    "snapshot {:?} not found in pool {} (see `condense snapshot list`)",
                    a.name,
                    ctx.path.display()
                );
            }
            true
        }
        None => {
            if !pool.volumes().iter().any(|(n, _)| *n == a.name) {
                bail!(
                    "volume {:?} not found in pool {} (see `condense volume list`)",
                    a.name,
                    ctx.path.display()
                );
            }
            false
        }
    };
    if !condense_nbd::is_exportable(&a.name) {
        bail!(
            "{:?} is an internal volume (its name starts with '.'): `condense serve` does not export it",
            a.name
        );
    }
    let xml = disk_xml(&a.name, &endpoint, &a.target, bus, a.readonly || snapshot)?;
    write!(ctx.out, "{xml}")?;
    Ok(ctx.done(&pool)?)
}

/// The endpoint the options name; the default is serve's default socket in `pool_dir`.
fn endpoint(a: &LibvirtXmlArgs, pool_dir: &Path) -> Result<Endpoint> {
    for (given, tls, option) in [
        (&a.tls, true, "--tls"),
        (&a.insecure_tcp, false, "--insecure-tcp"),
    ] {
        if let Some(hp) = given {
            let (host, port) = host_port(hp).with_context(|| format!("bad {option}"))?;
            return Ok(Endpoint::Tcp { host, port, tls });
        }
    }
    match &a.socket {
        Some(p) if p.is_absolute() => Ok(Endpoint::Unix(p.clone())),
        Some(p) => bail!(
            "--socket {}: libvirt needs an absolute path (libvirt and qemu do not run in this \
             directory), e.g. /run/condense/vm.sock",
            p.display()
        ),
        None => {
            let dir = std::path::absolute(pool_dir)
                .with_context(|| format!("cannot make {} absolute", pool_dir.display()))?;
            Ok(Endpoint::Unix(
                dir.join(condense_service::serve::DEFAULT_SOCKET_NAME),
            ))
        }
    }
}

/// `HOST`, `HOST:PORT`, `[IPV6]` or `[IPV6]:PORT`.
fn host_port(s: &str) -> Result<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .with_context(|| format!("{s:?}: an IPv6 address needs its closing ']'"))?;
        match after {
            "" => (h, None),
            _ => match after.strip_prefix(':') {
                Some(p) => (h, Some(p)),
                None => bail!("{s:?}: write [IPV6]:PORT"),
            },
        }
    } else {
        match s.split_once(':') {
            Some((_, p)) if p.contains(':') => {
                bail!("{s:?}: write an IPv6 address in brackets, e.g. [{s}]:{NBD_PORT}")
            }
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if host.is_empty() {
        bail!("{s:?} names no host: write HOST[:PORT]");
    }
    let port = match port {
        None => NBD_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => bail!("{s:?}: the port must be a number from 1 to 65535"),
        },
    };
    Ok((host.to_string(), port))
}

/// The bus libvirt attaches a target of this name to.
fn bus_of(target: &str) -> Result<&'static str> {
    let bus = [("vd", "virtio"), ("sd", "scsi"), ("hd", "ide")]
        .into_iter()
        .find_map(|(prefix, bus)| {
            let rest = target.strip_prefix(prefix)?;
            (!rest.is_empty() && rest.bytes().all(|b| b.is_ascii_lowercase())).then_some(bus)
        });
    bus.with_context(|| {
        format!("--target {target:?}: use vdX (virtio), sdX (SCSI) or hdX (IDE), e.g. vda or vdb")
    })
}

/// The `<disk>` element, ending in a newline.
fn disk_xml(
    export: &str,
    endpoint: &Endpoint,
    target: &str,
    bus: &str,
    readonly: bool,
) -> Result<String> {
    let name = escape(export)?;
    let (tls, host) = match endpoint {
        Endpoint::Unix(p) => {
            let path = p
                .to_str()
                .with_context(|| format!("the socket path {} is not UTF-8", p.display()))?;
            (
                String::new(),
                format!("<host transport='unix' socket='{}'/>", escape(path)?),
            )
        }
        Endpoint::Tcp { host, port, tls } => (
            format!(" tls='{}'", if *tls { "yes" } else { "no" }),
            format!("<host name='{}' port='{port}'/>", escape(host)?),
        ),
    };
    let readonly = if readonly { "  <readonly/>\n" } else { "" };
    // cache='none': the usual mode of a disk hosts share (nothing cached on the host when a
    // VM migrates); discard='unmap': the guest's TRIM frees the volume's blocks in the pool.
    Ok(format!(
        "<disk type='network' device='disk'>\n  \
         <driver name='qemu' type='raw' cache='none' discard='unmap'/>\n  \
         <source protocol='nbd' name='{name}'{tls}>\n    {host}\n  </source>\n  \
         <target dev='{target}' bus='{bus}'/>\n{readonly}</disk>\n"
    ))
}

/// `s` as an XML attribute value (between single or double quotes).
fn escape(s: &str) -> Result<String> {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&apos;"),
            '"' => out.push_str("&quot;"),
            c if c.is_control() => bail!("{s:?} holds a control character, which XML cannot carry"),
            c => out.push(c),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths_are_escaped() -> Result<()> {
        let xml = disk_xml(
            "a<b>&'\"c@snap",
            &Endpoint::Unix(PathBuf::from("/run/x&y.sock")),
            "vdb",
            "virtio",
            true,
        )?;
        assert!(
            xml.contains("name='a&lt;b&gt;&amp;&apos;&quot;c@snap'"),
            "{xml}"
        );
        assert!(xml.contains("socket='/run/x&amp;y.sock'"), "{xml}");
        assert!(xml.contains("<readonly/>"), "{xml}");
        assert!(escape("a\u{1}b").is_err());
        Ok(())
    }

    #[test]
    fn tcp_endpoints_say_whether_tls() -> Result<()> {
        let tcp = |host: &str, tls| Endpoint::Tcp {
            host: host.to_string(),
            port: 10809,
            tls,
        };
        let xml = disk_xml("vm1", &tcp("storage1", true), "vda", "virtio", false)?;
        assert!(
            xml.contains("<source protocol='nbd' name='vm1' tls='yes'>"),
            "{xml}"
        );
        assert!(
            xml.contains("<host name='storage1' port='10809'/>"),
            "{xml}"
        );
        assert!(!xml.contains("readonly"), "{xml}");
        let xml = disk_xml("vm1", &tcp("::1", false), "vda", "virtio", false)?;
        assert!(
            xml.contains("tls='no'") && xml.contains("name='::1'"),
            "{xml}"
        );
        Ok(())
    }

    #[test]
    fn host_and_port_forms() -> Result<()> {
        assert_eq!(host_port("h")?, ("h".to_string(), 10809));
        assert_eq!(host_port("h:1234")?, ("h".to_string(), 1234));
        assert_eq!(host_port("[::1]")?, ("::1".to_string(), 10809));
        assert_eq!(host_port("[fe80::1]:99")?, ("fe80::1".to_string(), 99));
        for bad in ["::1", "h:0", "h:x", ":10809", "[::1", "[::1]x", "h:70000"] {
            assert!(host_port(bad).is_err(), "{bad} accepted");
        }
        Ok(())
    }

    #[test]
    fn targets_name_their_bus() {
        assert_eq!(bus_of("vda").ok(), Some("virtio"));
        assert_eq!(bus_of("sdb").ok(), Some("scsi"));
        assert_eq!(bus_of("hdc").ok(), Some("ide"));
        for bad in ["vd", "xvda", "vd1", "vdA", "vda'/><x", ""] {
            assert!(bus_of(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn endpoints_from_the_options() -> Result<()> {
        let args =
            |socket: Option<&str>, tls: Option<&str>, insecure: Option<&str>| LibvirtXmlArgs {
                name: "vm1".to_string(),
                socket: socket.map(PathBuf::from),
                tls: tls.map(str::to_string),
                insecure_tcp: insecure.map(str::to_string),
                target: "vda".to_string(),
                readonly: false,
            };
        let pool = Path::new("/srv/pool");
        assert!(endpoint(&args(Some("x.sock"), None, None), pool).is_err());
        assert_eq!(
            endpoint(&args(None, None, None), pool)?,
            Endpoint::Unix(PathBuf::from("/srv/pool/nbd.sock"))
        );
        let tcp = |tls| Endpoint::Tcp {
            host: "h".to_string(),
            port: 99,
            tls,
        };
        assert_eq!(endpoint(&args(None, Some("h:99"), None), pool)?, tcp(true));
        assert_eq!(endpoint(&args(None, None, Some("h:99")), pool)?, tcp(false));
        Ok(())
    }
}
