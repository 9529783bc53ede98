//! Header names and the small pure pieces of the Connect unary protocol.

use std::{io::Read, time::Duration};

use flate2::{Compression, read::GzDecoder, write::GzEncoder};

pub const PROTOCOL_VERSION_HEADER: &str = "connect-protocol-version";
pub const PROTOCOL_VERSION: &str = "1";
pub const TIMEOUT_HEADER: &str = "connect-timeout-ms";

/// Connect allows at most ten digits in `Connect-Timeout-Ms`.
const MAX_TIMEOUT_DIGITS: usize = 10;

/// Why a `Connect-Timeout-Ms` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid Connect-Timeout-Ms {0:?}: expected 1 to 10 ASCII digits")]
pub struct InvalidTimeout(pub String);

/// Parses `Connect-Timeout-Ms` (a positive count of milliseconds, at most ten digits).
///
/// # Errors
/// On anything but 1–10 ASCII digits.
pub fn parse_timeout(value: &str) -> Result<Duration, InvalidTimeout> {
    if value.is_empty() || value.len() > MAX_TIMEOUT_DIGITS || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(InvalidTimeout(value.to_owned()));
    }
    value.parse::<u64>().map(Duration::from_millis).map_err(|_| InvalidTimeout(value.to_owned()))
}

/// Formats a deadline for `Connect-Timeout-Ms`, or `None` when it does not fit in ten
/// digits (connect-go then omits the header). A sub-millisecond remainder rounds up
/// so that a live deadline is never sent as 0.
pub fn format_timeout(timeout: Duration) -> Option<String> {
    let millis = timeout.as_nanos().div_ceil(1_000_000);
    let text = millis.to_string();
    (text.len() <= MAX_TIMEOUT_DIGITS).then_some(text)
}

/// Whether an `Accept-Encoding` value allows gzip (`gzip` listed without `q=0`).
pub fn accepts_gzip(value: &str) -> bool {
    value.split(',').any(|item| {
        let mut parts = item.split(';');
        let name = parts.next().unwrap_or("").trim();
        let refused = parts.any(|p| {
            let p = p.trim().replace(' ', "");
            p == "q=0" || p == "q=0.0" || p == "q=0.00" || p == "q=0.000"
        });
        name.eq_ignore_ascii_case("gzip") && !refused
    })
}

/// Why a gzip body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GunzipError {
    #[error("gzip body larger than {limit} bytes once decompressed")]
    TooLarge { limit: usize },
    #[error("invalid gzip body")]
    Invalid(#[source] std::io::Error),
}

/// Decompresses `data`, refusing output above `limit` bytes (a small gzip body can
/// expand enormously, so the limit applies after decompression).
///
/// # Errors
/// When the data is not gzip or expands beyond `limit`.
pub fn gunzip(data: &[u8], limit: usize) -> Result<Vec<u8>, GunzipError> {
    let mut out = Vec::new();
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    GzDecoder::new(data).take(cap).read_to_end(&mut out).map_err(GunzipError::Invalid)?;
    if out.len() > limit {
        return Err(GunzipError::TooLarge { limit });
    }
    Ok(out)
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = GzEncoder::new(Vec::with_capacity(data.len() / 2 + 32), Compression::fast());
    // Writing into a Vec cannot fail.
    let _ = encoder.write_all(data);
    encoder.finish().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_header_parsing() {
        let table: &[(&str, Option<u64>)] = &[
            ("0", Some(0)),
            ("1", Some(1)),
            ("5000", Some(5000)),
            ("9999999999", Some(9_999_999_999)),
            ("10000000000", None),
            ("", None),
            ("-1", None),
            ("+5", None),
            ("1.5", None),
            (" 5", None),
            ("5s", None),
        ];
        for &(value, want) in table {
            assert_eq!(parse_timeout(value).ok(), want.map(Duration::from_millis), "{value:?}");
        }
    }

    #[test]
    fn timeout_header_formatting() {
        assert_eq!(format_timeout(Duration::from_millis(5000)).as_deref(), Some("5000"));
        assert_eq!(format_timeout(Duration::from_micros(1)).as_deref(), Some("1"));
        assert_eq!(format_timeout(Duration::from_micros(1500)).as_deref(), Some("2"));
        assert_eq!(format_timeout(Duration::from_millis(9_999_999_999)).as_deref(), Some("9999999999"));
        assert_eq!(format_timeout(Duration::from_millis(10_000_000_000)), None);
        assert_eq!(format_timeout(Duration::MAX), None);
    }

    #[test]
    fn accept_encoding() {
        let table: &[(&str, bool)] = &[
            ("gzip", true),
            ("GZIP", true),
            ("identity, gzip", true),
            ("gzip;q=0.5, br", true),
            ("gzip;q=0", false),
            ("br, identity", false),
            ("", false),
            ("gzipx", false),
        ];
        for &(value, want) in table {
            assert_eq!(accepts_gzip(value), want, "{value:?}");
        }
    }

    #[test]
    fn gzip_round_trip_and_limits() {
        let data = vec![b'a'; 10_000];
        let packed = gzip(&data);
        assert!(packed.len() < 200);
        assert_eq!(gunzip(&packed, 10_000).unwrap(), data);
        assert!(matches!(gunzip(&packed, 9_999), Err(GunzipError::TooLarge { limit: 9_999 })));
        assert!(matches!(gunzip(b"not gzip", 100), Err(GunzipError::Invalid(_))));
    }
}
