//! Byte counts as users write them on the command line.

/// `4096`, `512K`, `512M`, `12G`, `1.5G`, `2T` (binary multiples; an optional `B` or `iB` suffix,
/// so `512MiB` and `12GB` read the same) → bytes. `None` for anything else, zero, a negative or a
/// non-finite number.
pub fn parse_bytes(s: &str) -> Option<u64> {
    let t = s.trim_end_matches("iB").trim_end_matches('B');
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        Some('T' | 't') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let v: f64 = num.parse().ok()?;
    (v.is_finite() && v > 0.0).then_some((v * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse_with_binary_units() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("512K"), Some(512 << 10));
        assert_eq!(parse_bytes("512MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("12G"), Some(12 << 30));
        assert_eq!(parse_bytes("12GB"), Some(12 << 30));
        assert_eq!(parse_bytes("1.5G"), Some(3 << 29));
        assert_eq!(parse_bytes("2t"), Some(2 << 40));
        for bad in ["", "-1G", "0", "G", "lots", "nanG", "infG", "auto"] {
            assert_eq!(parse_bytes(bad), None, "{bad}");
        }
    }
}
