//! Pure parser for `/proc/self/mountinfo` (proc_pid_mountinfo(5)) and the questions the
//! storage code asks of it ("is this path a mountpoint?", "what is mounted below it?").
//!
//! A line looks like
//! `36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue`:
//! mount id, parent id, `major:minor`, root, mount point, per-mount options, zero or more
//! optional fields, a lone `-`, then fs type, source and super options. The kernel escapes
//! space, tab, newline and backslash in paths, type and source as `\ooo` octal, and fields
//! are separated by exactly one space (a field such as the source can be empty, so runs of
//! spaces must not be collapsed).

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`, unescaped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// The directory of the filesystem that forms the root of this mount (bind mounts).
    pub root: PathBuf,
    /// Where it is mounted, relative to the reading process's root.
    pub mount_point: PathBuf,
    pub mount_options: String,
    /// `shared:N`, `master:N`, `propagate_from:N`, `unbindable`.
    pub optional_fields: Vec<String>,
    pub fstype: String,
    /// Free-form (`/dev/loop3`, `tmpfs`, `none`, or empty); bytes kept exactly.
    pub source: OsString,
    pub super_options: String,
}

/// Why a mountinfo line could not be parsed. Lines are numbered from 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("line {line}: expected 6 fields before the optional fields, found {found}")]
    TooFewFields { line: usize, found: usize },
    #[error("line {line}: no ` - ` separator after the optional fields")]
    MissingSeparator { line: usize },
    #[error("line {line}: expected fs type, source and super options after ` - `, found {found}")]
    TooFewFieldsAfterSeparator { line: usize, found: usize },
    #[error("line {line}: {field} is not a decimal number: {value:?}")]
    BadNumber { line: usize, field: &'static str, value: String },
    #[error("line {line}: device {value:?} is not major:minor")]
    BadDevice { line: usize, value: String },
}

/// Parses the whole file. Blank lines are skipped.
///
/// # Errors
/// The first malformed line.
pub fn parse(text: &[u8]) -> Result<Vec<MountEntry>, ParseError> {
    text.split(|&b| b == b'\n').enumerate().filter(|(_, line)| !line.is_empty()).map(|(index, line)| parse_line(index + 1, line)).collect()
}

fn parse_line(line: usize, bytes: &[u8]) -> Result<MountEntry, ParseError> {
    let fields: Vec<&[u8]> = bytes.split(|&b| b == b' ').collect();
    if fields.len() < 6 {
        return Err(ParseError::TooFewFields { line, found: fields.len() });
    }
    // The separator search starts after the mount options, so a directory literally
    // named "-" as root or mount point cannot be mistaken for it.
    let separator = fields.iter().skip(6).position(|field| *field == b"-").map(|offset| offset + 6).ok_or(ParseError::MissingSeparator { line })?;
    let after = &fields[separator + 1..];
    if after.len() < 3 {
        return Err(ParseError::TooFewFieldsAfterSeparator { line, found: after.len() });
    }
    let (major, minor) = parse_device(line, fields[2])?;
    Ok(MountEntry {
        mount_id: parse_number(line, "mount id", fields[0])?,
        parent_id: parse_number(line, "parent id", fields[1])?,
        major,
        minor,
        root: PathBuf::from(OsString::from_vec(unescape(fields[3]))),
        mount_point: PathBuf::from(OsString::from_vec(unescape(fields[4]))),
        mount_options: lossy(fields[5]),
        optional_fields: fields[6..separator].iter().map(|f| lossy(f)).collect(),
        fstype: lossy(&unescape(after[0])),
        source: OsString::from_vec(unescape(after[1])),
        // Super options are the rest of the line; they never contain a raw space, but
        // joining keeps whatever a future kernel might put there.
        super_options: lossy(&after[2..].join(&b' ')),
    })
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Strict decimal `u32`: digits only (no sign, no spaces).
fn parse_number(line: usize, field: &'static str, bytes: &[u8]) -> Result<u32, ParseError> {
    let bad = || ParseError::BadNumber { line, field, value: lossy(bytes) };
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    std::str::from_utf8(bytes).ok().and_then(|s| s.parse().ok()).ok_or_else(bad)
}

fn parse_device(line: usize, bytes: &[u8]) -> Result<(u32, u32), ParseError> {
    let bad = || ParseError::BadDevice { line, value: lossy(bytes) };
    let colon = bytes.iter().position(|&b| b == b':').ok_or_else(bad)?;
    let major = parse_number(line, "major", &bytes[..colon]).map_err(|_| bad())?;
    let minor = parse_number(line, "minor", &bytes[colon + 1..]).map_err(|_| bad())?;
    Ok((major, minor))
}

/// Undoes the kernel's `\ooo` escaping. Anything that is not a backslash followed by
/// three octal digits with a value below 256 is kept literally (the kernel never emits
/// that, and being lenient beats refusing to boot).
#[must_use]
pub fn unescape(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && let Some(value) = octal3(bytes.get(i + 1..i + 4))
        {
            out.push(value);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

fn octal3(digits: Option<&[u8]>) -> Option<u8> {
    let digits = digits?;
    if !digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
        return None;
    }
    let value = digits.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
    u8::try_from(value).ok()
}

/// The mount visible at exactly `path`, if any. `path` must already be canonical
/// (mountinfo holds resolved paths). When several mounts are stacked on the same
/// directory the visible one is the top of the stack: the one that is not the parent of
/// another mount at the same place.
#[must_use]
pub fn mount_at<'a>(entries: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    let candidates: Vec<&MountEntry> = entries.iter().filter(|entry| entry.mount_point == path).collect();
    candidates
        .iter()
        .rev()
        .find(|entry| !candidates.iter().any(|other| other.parent_id == entry.mount_id && other.mount_id != entry.mount_id))
        .or(candidates.last())
        .copied()
}

/// Mounts strictly below `path`, deepest first (then latest first), i.e. in an order
/// that can be unmounted one by one.
#[must_use]
pub fn submounts_deepest_first<'a>(entries: &'a [MountEntry], path: &Path) -> Vec<&'a MountEntry> {
    let mut below: Vec<(usize, &MountEntry)> =
        entries.iter().enumerate().filter(|(_, entry)| entry.mount_point != path && entry.mount_point.starts_with(path)).collect();
    below.sort_by(|(ia, a), (ib, b)| {
        let depth = |e: &MountEntry| e.mount_point.components().count();
        depth(b).cmp(&depth(a)).then(ib.cmp(ia))
    });
    below.into_iter().map(|(_, entry)| entry).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> MountEntry {
        let mut entries = parse(line.as_bytes()).expect("parses");
        assert_eq!(entries.len(), 1, "{line}");
        entries.remove(0)
    }

    #[test]
    fn parses_the_man_page_example() {
        let e = one("36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue");
        assert_eq!(
            e,
            MountEntry {
                mount_id: 36,
                parent_id: 35,
                major: 98,
                minor: 0,
                root: "/mnt1".into(),
                mount_point: "/mnt2".into(),
                mount_options: "rw,noatime".into(),
                optional_fields: vec!["master:1".into()],
                fstype: "ext3".into(),
                source: "/dev/root".into(),
                super_options: "rw,errors=continue".into(),
            }
        );
    }

    #[test]
    fn optional_fields_zero_one_many() {
        let cases: &[(&str, &[&str])] = &[
            ("1 0 0:1 / / rw - rootfs rootfs rw", &[]),
            ("1 0 0:1 / / rw shared:1 - ext4 /dev/vda rw", &["shared:1"]),
            ("1 0 0:1 / / rw shared:5 master:2 propagate_from:3 unbindable - ext4 /dev/vda rw", &["shared:5", "master:2", "propagate_from:3", "unbindable"]),
        ];
        for (line, optional) in cases {
            let e = one(line);
            let expected: Vec<String> = optional.iter().map(|s| (*s).to_owned()).collect();
            assert_eq!(e.optional_fields, expected, "{line}");
            assert_eq!(e.mount_point, Path::new("/"), "{line}");
        }
    }

    #[test]
    fn unescapes_octal_in_every_path_like_field() {
        let e = one(r"50 27 0:40 /a\040b /mnt/with\040space\011tab\012nl\134bs rw - fuse\040x my\040src rw");
        assert_eq!(e.root, Path::new("/a b"));
        assert_eq!(e.mount_point, Path::new("/mnt/with space\ttab\nnl\\bs"));
        assert_eq!(e.fstype, "fuse x");
        assert_eq!(e.source, OsString::from("my src"));
    }

    #[test]
    fn unescape_table() {
        let cases: &[(&[u8], &[u8])] = &[
            (b"", b""),
            (b"plain", b"plain"),
            (br"\040", b" "),
            (br"a\040", b"a "),
            (br"\040\040", b"  "),
            (br"\134", b"\\"),
            (br"\134040", b"\\040"), // an escaped backslash followed by digits
            (br"\0", br"\0"),        // too short: literal
            (br"\04", br"\04"),
            (br"\08x", br"\08x"), // 8 is not octal
            (br"\400", br"\400"), // > 255: literal
            (br"\377", b"\xff"),  // non-UTF-8 byte survives
            (br"trail\\", br"trail\\"),
        ];
        for (input, expected) in cases {
            assert_eq!(unescape(input), expected.to_vec(), "{:?}", String::from_utf8_lossy(input));
        }
    }

    #[test]
    fn empty_source_is_a_field_not_a_missing_one() {
        // "- tmpfs  rw": fstype tmpfs, empty source, super options rw.
        let e = one("60 27 0:50 / /x rw,relatime - tmpfs  rw,size=4k");
        assert_eq!(e.fstype, "tmpfs");
        assert_eq!(e.source, OsString::new());
        assert_eq!(e.super_options, "rw,size=4k");
    }

    #[test]
    fn a_directory_named_dash_is_not_the_separator() {
        let e = one("61 27 0:51 - /- rw - tmpfs tmpfs rw");
        assert_eq!(e.root, Path::new("-"));
        assert_eq!(e.mount_point, Path::new("/-"));
        assert!(e.optional_fields.is_empty());
        assert_eq!(e.fstype, "tmpfs");
    }

    #[test]
    fn malformed_lines_are_errors_with_line_numbers() {
        let ok = "1 0 0:1 / / rw - ext4 /dev/vda rw\n";
        let cases: &[(&str, ParseError)] = &[
            ("1 0 0:1 / /", ParseError::TooFewFields { line: 2, found: 5 }),
            ("1 0 0:1 / / rw shared:1 ext4 /dev/vda rw", ParseError::MissingSeparator { line: 2 }),
            ("1 0 0:1 / / rw - ext4 /dev/vda", ParseError::TooFewFieldsAfterSeparator { line: 2, found: 2 }),
            ("x 0 0:1 / / rw - ext4 /dev/vda rw", ParseError::BadNumber { line: 2, field: "mount id", value: "x".into() }),
            ("1 -1 0:1 / / rw - ext4 /dev/vda rw", ParseError::BadNumber { line: 2, field: "parent id", value: "-1".into() }),
            ("1 0 01 / / rw - ext4 /dev/vda rw", ParseError::BadDevice { line: 2, value: "01".into() }),
            ("1 0 0:+1 / / rw - ext4 /dev/vda rw", ParseError::BadDevice { line: 2, value: "0:+1".into() }),
            ("1 0 :1 / / rw - ext4 /dev/vda rw", ParseError::BadDevice { line: 2, value: ":1".into() }),
        ];
        for (bad, expected) in cases {
            let text = format!("{ok}{bad}\n");
            assert_eq!(parse(text.as_bytes()), Err(expected.clone()), "{bad}");
        }
    }

    #[test]
    fn blank_lines_and_missing_final_newline() {
        let text = "\n1 0 0:1 / / rw - ext4 /dev/vda rw\n\n2 1 0:2 / /proc rw - proc proc rw";
        let entries = parse(text.as_bytes()).expect("parses");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1].mount_point, Path::new("/proc"));
        assert_eq!(parse(b""), Ok(vec![]));
    }

    /// A realistic container table: root overlay, /dev, a docker volume deeper down, a
    /// stacked mount, and a path with a space.
    const TABLE: &str = "\
100 90 0:60 / / rw,relatime master:40 - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
101 100 0:61 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
102 100 0:62 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
103 100 254:1 /pods/x/volumes/data /var/lib/docker rw,relatime - ext4 /dev/vda1 rw
104 103 7:3 / /var/lib/docker rw,noatime - ext4 /dev/loop3 rw
105 104 0:70 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw
106 104 0:71 / /var/lib/docker/containers/x/mounts/shm rw - tmpfs shm rw
107 105 0:72 / /var/lib/docker/overlay2/abc/merged/proc rw - proc proc rw
108 100 0:73 / /var/lib/dockerx rw - tmpfs tmpfs rw
109 100 0:74 / /with\\040space rw - tmpfs tmpfs rw
";

    #[test]
    fn mount_at_table() {
        let entries = parse(TABLE.as_bytes()).expect("parses");
        let cases: &[(&str, Option<(u32, &str)>)] = &[
            ("/", Some((100, "overlay"))),
            ("/proc", Some((101, "proc"))),
            ("/dev", Some((102, "tmpfs"))),
            ("/dev/", Some((102, "tmpfs"))),          // trailing slash is the same path
            ("/var/lib/docker", Some((104, "ext4"))), // top of the stack, not 103
            ("/var/lib/dockerx", Some((108, "tmpfs"))),
            ("/var/lib/docker/overlay2/abc/merged", Some((105, "overlay"))),
            ("/var/lib", None),                 // a prefix of a mountpoint is not one
            ("/var/lib/dock", None),            // string prefix, not a component
            ("/var/lib/docker/overlay2", None), // inside a mount, not at one
            ("/with space", Some((109, "tmpfs"))),
            ("/with\\040space", None),
        ];
        for (path, expected) in cases {
            let got = mount_at(&entries, Path::new(path)).map(|e| (e.mount_id, e.fstype.as_str()));
            assert_eq!(got, *expected, "{path}");
        }
    }

    #[test]
    fn stacked_mounts_listed_out_of_order_still_pick_the_top() {
        let text = "\
1 0 0:1 / / rw - ext4 /dev/vda rw
20 5 0:3 / /m rw - tmpfs top rw
5 1 0:2 / /m rw - tmpfs bottom rw
";
        let entries = parse(text.as_bytes()).expect("parses");
        let top = mount_at(&entries, Path::new("/m")).expect("mounted");
        assert_eq!(top.source, OsString::from("top"));
    }

    #[test]
    fn submounts_are_strictly_below_and_deepest_first() {
        let entries = parse(TABLE.as_bytes()).expect("parses");
        let ids: Vec<u32> = submounts_deepest_first(&entries, Path::new("/var/lib/docker")).iter().map(|e| e.mount_id).collect();
        // 107 is 7 components deep, 106 and 105 are 6 deep (later one first); 103/104
        // are the mountpoint itself and 108 (/var/lib/dockerx) is a sibling.
        assert_eq!(ids, vec![107, 106, 105]);
        assert!(submounts_deepest_first(&entries, Path::new("/proc")).is_empty());
    }

    #[test]
    fn parses_this_machines_mountinfo() {
        let text = std::fs::read("/proc/self/mountinfo").expect("readable");
        let entries = parse(&text).expect("the running kernel's format parses");
        assert!(mount_at(&entries, Path::new("/")).is_some());
    }
}
