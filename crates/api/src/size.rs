//! Sizes as people write and read them: `100G`, `4K`, `1.5T`; binary units (K = 1024). Shared by
//! the CLI and the library crates (estimate, benchmark) that print or parse sizes.

/// Parse `123`, `4K`, `100G`, `1.5T`, `64MiB` (units are powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                'P' => 1 << 50,
                _ => return Err(format!("unknown size unit in {s:?}: use K, M, G, T or P")),
            };
            (&t[..t.len() - 1], m)
        }
        _ => (t, 1),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| format!("size {s:?} is too large"));
    }
    match num.parse::<f64>() {
        Ok(f) if f >= 0.0 && f.is_finite() && f * (mult as f64) < 1.8e19 => {
            Ok((f * mult as f64).round() as u64)
        }
        _ => Err(format!(
            "invalid size {s:?}: write a number with an optional K/M/G/T suffix, like 100G"
        )),
    }
}

/// `1.5 GiB`, `512 B`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("100G"), Ok(100 << 30));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert_eq!(parse_size("12345"), Ok(12345));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("99999999999P").is_err());
        assert_eq!(human(1536), "1.50 KiB");
        assert_eq!(human(12), "12 B");
    }
}
