//! Parsers for sizes and durations in settings, shared by every command. Pure and
//! table-tested; the error text is what the user sees after the setting's name.

use std::time::Duration;

/// Parses `20G`, `512M`, `1.5G`, `4096` (bytes), `64K`; binary units (K = 1024).
///
/// # Errors
/// A message saying what is accepted.
pub fn parse_size(value: &str) -> Result<u64, String> {
    let text = value.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let multiplier: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KI" | "KIB" => 1 << 10,
        "M" | "MI" | "MIB" => 1 << 20,
        "G" | "GI" | "GIB" => 1 << 30,
        "T" | "TI" | "TIB" => 1 << 40,
        _ => return Err(format!("{value:?} is not a size: use a number with an optional unit K, M, G or T (e.g. 20G)")),
    };
    let number: f64 = number.parse().map_err(|_| format!("{value:?} is not a size: use a number with an optional unit K, M, G or T (e.g. 20G)"))?;
    let bytes = number * multiplier as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(format!("{value:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// Parses `25s`, `500ms`, `2m`, `1h`, `1m30s`, `7d`; a bare number means seconds.
///
/// # Errors
/// A message saying what is accepted.
pub fn parse_duration(value: &str) -> Result<Duration, String> {
    let invalid = || format!("{value:?} is not a duration: use e.g. 500ms, 25s, 2m, 1h, 7d or 1m30s");
    let text = value.trim();
    if text.is_empty() {
        return Err(invalid());
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map(Duration::from_secs).map_err(|_| invalid());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(invalid)?;
        if digits == 0 {
            return Err(invalid());
        }
        let number: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let part = match &rest[..unit_len] {
            "ms" => Duration::from_millis(number),
            "s" => Duration::from_secs(number),
            "m" => Duration::from_secs(number.checked_mul(60).ok_or_else(invalid)?),
            "h" => Duration::from_secs(number.checked_mul(3600).ok_or_else(invalid)?),
            "d" => Duration::from_secs(number.checked_mul(24 * 3600).ok_or_else(invalid)?),
            _ => return Err(invalid()),
        };
        total = total.checked_add(part).ok_or_else(invalid)?;
        rest = &rest[unit_len..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let table: &[(&str, Option<u64>)] = &[
            ("20G", Some(20 << 30)),
            ("20g", Some(20 << 30)),
            ("20GiB", Some(20 << 30)),
            ("512M", Some(512 << 20)),
            ("1.5G", Some(3 << 29)),
            ("64K", Some(64 << 10)),
            ("4096", Some(4096)),
            ("1T", Some(1 << 40)),
            ("0", None),
            ("", None),
            ("G", None),
            ("-1G", None),
            ("20X", None),
            ("twenty", None),
            ("1e3", None),
        ];
        for &(value, want) in table {
            assert_eq!(parse_size(value).ok(), want, "{value:?}");
        }
    }

    #[test]
    fn durations() {
        let table: &[(&str, Option<Duration>)] = &[
            ("25s", Some(Duration::from_secs(25))),
            ("25", Some(Duration::from_secs(25))),
            ("500ms", Some(Duration::from_millis(500))),
            ("2m", Some(Duration::from_secs(120))),
            ("1h", Some(Duration::from_secs(3600))),
            ("1m30s", Some(Duration::from_secs(90))),
            ("7d", Some(Duration::from_secs(7 * 24 * 3600))),
            ("0s", Some(Duration::ZERO)),
            ("", None),
            ("s", None),
            ("5 s", None),
            ("5x", None),
            ("-5s", None),
            ("1.5s", None),
            ("99999999999999999999h", None),
        ];
        for &(value, want) in table {
            assert_eq!(parse_duration(value).ok(), want, "{value:?}");
        }
    }
}
