//! Where the S3 backend's objects are in the bucket, and what the small ones say: the names
//! of unit objects, checkpoint manifests and the writer's lease, and the bytes of a manifest
//! and a lease. Owns no I/O (`store` and `lease` put and get them).
//!
//! ```text
//! PREFIX/units/<file id>/<unit index>.<generation>   a unit's bytes, written whole, never overwritten
//! PREFIX/segments/<id>                               pieces of many units, packed (`segments`)
//! PREFIX/manifests/<seq>                              a checkpoint: header + the namespace database
//! PREFIX/lease                                        the writing mount, put IfAbsent
//! ```
//!
//! Numbers are 16 lower-case hex digits, so that a listing's key order is their numeric order:
//! the newest manifest is the last one listed, and a file's units list in unit order.

use std::fmt::Write as _;

/// `PREFIX/` (or nothing for a whole bucket): every key starts with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
}

/// 16 hex digits: u64's width.
fn hex(n: u64) -> String {
    format!("{n:016x}")
}

fn parse_hex(text: &str) -> Option<u64> {
    (text.len() == 16 && text.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
        .then(|| u64::from_str_radix(text, 16).ok())
        .flatten()
}

impl Layout {
    /// `prefix` without slashes at either end ("" for the whole bucket).
    pub fn new(prefix: &str) -> Layout {
        let prefix = prefix.trim_matches('/');
        Layout { prefix: if prefix.is_empty() { String::new() } else { format!("{prefix}/") } }
    }

    pub fn unit_key(&self, file: u64, unit: u64, generation: u64) -> String {
        format!("{}units/{}/{}.{}", self.prefix, hex(file), hex(unit), hex(generation))
    }

    pub fn units_prefix(&self) -> String {
        format!("{}units/", self.prefix)
    }

    pub fn segment_key(&self, id: u64) -> String {
        format!("{}{}", self.segments_prefix(), hex(id))
    }

    pub fn segments_prefix(&self) -> String {
        format!("{}segments/", self.prefix)
    }

    /// The (file, unit, generation) a listed unit key names; None for anything else.
    pub fn unit_of_key(&self, key: &str) -> Option<(u64, u64, u64)> {
        let (file, rest) = key.strip_prefix(&self.units_prefix())?.split_once('/')?;
        let (unit, generation) = rest.split_once('.')?;
        Some((parse_hex(file)?, parse_hex(unit)?, parse_hex(generation)?))
    }

    /// The segment a listed segment key names; None for anything else.
    pub fn segment_of_key(&self, key: &str) -> Option<u64> {
        parse_hex(key.strip_prefix(&self.segments_prefix())?)
    }

    pub fn manifests_prefix(&self) -> String {
        format!("{}manifests/", self.prefix)
    }

    pub fn manifest_key(&self, seq: u64) -> String {
        format!("{}{}", self.manifests_prefix(), hex(seq))
    }

    /// The sequence number a listed manifest key names; None for anything else under the
    /// prefix (never read as a manifest).
    pub fn manifest_seq(&self, key: &str) -> Option<u64> {
        parse_hex(key.strip_prefix(&self.manifests_prefix())?)
    }

    pub fn lease_key(&self) -> String {
        format!("{}lease", self.prefix)
    }
}

/// The first line of every manifest: the format and its version.
const MANIFEST_MAGIC: &str = "coalescefs-s3-manifest 1";
/// The most a manifest's header may take; a reader fetches this much first.
pub const MANIFEST_HEADER_MAX: usize = 4096;

/// A checkpoint manifest: a text header (the magic line, `key=value` lines, a blank line)
/// followed by the namespace database's bytes, whose length and crc32c the header gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub seq: u64,
    /// The lease id of the mount that wrote it.
    pub writer: String,
    pub unit_bytes: u64,
    pub database: Vec<u8>,
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut header = String::new();
        let _ = writeln!(header, "{MANIFEST_MAGIC}");
        let _ = writeln!(header, "seq={}", self.seq);
        let _ = writeln!(header, "writer={}", self.writer);
        let _ = writeln!(header, "unit_bytes={}", self.unit_bytes);
        let _ = writeln!(header, "database_bytes={}", self.database.len());
        let _ = writeln!(header, "database_crc32c={:08x}", crc32c::crc32c(&self.database));
        header.push('\n');
        assert!(header.len() <= MANIFEST_HEADER_MAX, "a manifest header of {} bytes", header.len());
        let mut out = header.into_bytes();
        out.extend_from_slice(&self.database);
        out
    }

    /// The manifest in `bytes`, checked whole (length and checksum): an error says what is
    /// wrong, for the person whose mount it stops.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, String> {
        let end = bytes
            .windows(2)
            .take(MANIFEST_HEADER_MAX)
            .position(|w| w == b"\n\n")
            .ok_or("no header (not a coalescefs manifest)")?;
        let header = std::str::from_utf8(&bytes[..end]).map_err(|_| "a header that is not text")?;
        let mut lines = header.lines();
        if lines.next() != Some(MANIFEST_MAGIC) {
            return Err(format!("not a manifest of this version (expected '{MANIFEST_MAGIC}')"));
        }
        let mut fields = std::collections::HashMap::new();
        for line in lines {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("a header line without '=': {line}"))?;
            fields.insert(k, v);
        }
        let field = |k: &str| fields.get(k).copied().ok_or_else(|| format!("no {k} in the header"));
        let number = |k: &str| field(k)?.parse::<u64>().map_err(|_| format!("{k} is not a number"));
        let database = bytes[end + 2..].to_vec();
        if database.len() as u64 != number("database_bytes")? {
            return Err(format!(
                "{} database bytes where the header says {}",
                database.len(),
                field("database_bytes")?
            ));
        }
        let crc = u32::from_str_radix(field("database_crc32c")?, 16).map_err(|_| "a checksum that is not hex")?;
        if crc32c::crc32c(&database) != crc {
            return Err("the database's checksum does not match (a damaged manifest)".into());
        }
        Ok(Manifest {
            seq: number("seq")?,
            writer: field("writer")?.to_owned(),
            unit_bytes: number("unit_bytes")?,
            database,
        })
    }
}

/// The first line of a lease object.
const LEASE_MAGIC: &str = "coalescefs-s3-lease 1";

/// Who holds the prefix for writing: the body of `PREFIX/lease`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseHolder {
    /// Random, kept in the holder's state directory: the same state directory after a crash
    /// takes its own lease back.
    pub id: String,
    pub host: String,
    pub state_dir: String,
    pub pid: u32,
    /// Seconds since the epoch when it was taken.
    pub since: u64,
}

impl LeaseHolder {
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{LEASE_MAGIC}\nid={}\nhost={}\nstate={}\npid={}\nsince={}\n",
            self.id, self.host, self.state_dir, self.pid, self.since
        )
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Option<LeaseHolder> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut lines = text.lines();
        if lines.next()? != LEASE_MAGIC {
            return None;
        }
        let fields: std::collections::HashMap<_, _> = lines.filter_map(|l| l.split_once('=')).collect();
        Some(LeaseHolder {
            id: fields.get("id")?.to_string(),
            host: fields.get("host")?.to_string(),
            state_dir: fields.get("state")?.to_string(),
            pid: fields.get("pid")?.parse().ok()?,
            since: fields.get("since")?.parse().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sort_in_numeric_order_and_parse_back() {
        let layout = Layout::new("/tree/");
        assert_eq!(
            layout.unit_key(5, 2, 0x1_0000_0003),
            "tree/units/0000000000000005/0000000000000002.0000000100000003"
        );
        let (a, b) = (layout.manifest_key(9), layout.manifest_key(10));
        assert!(a < b, "{a} sorts before {b}");
        assert_eq!(layout.manifest_seq(&b), Some(10));
        assert_eq!(layout.manifest_seq("tree/manifests/junk"), None);
        assert_eq!(layout.manifest_seq("tree/manifests/000000000000000A"), None);
        assert_eq!(Layout::new("").lease_key(), "lease");
        assert_eq!(layout.unit_of_key(&layout.unit_key(5, 2, 0x1_0000_0003)), Some((5, 2, 0x1_0000_0003)));
        assert_eq!(layout.segment_of_key(&layout.segment_key(77)), Some(77));
        assert_eq!(layout.unit_of_key("tree/units/0000000000000005/junk"), None);
        assert_eq!(layout.segment_of_key("tree/units/0000000000000005"), None);
    }

    #[test]
    fn a_manifest_reads_back_whole_and_a_damaged_one_is_refused() {
        let m =
            Manifest { seq: 7, writer: "abc".into(), unit_bytes: 1 << 20, database: b"SQLite format 3\0...".to_vec() };
        let bytes = m.encode();
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(Manifest::decode(&bad).unwrap_err().contains("checksum"));
        assert!(Manifest::decode(&bytes[..bytes.len() - 1]).unwrap_err().contains("database bytes"));
        assert!(Manifest::decode(b"hello\n\nworld").is_err());
    }

    #[test]
    fn a_lease_reads_back() {
        let l = LeaseHolder { id: "x1".into(), host: "h".into(), state_dir: "/s".into(), pid: 4, since: 99 };
        assert_eq!(LeaseHolder::decode(&l.encode()), Some(l));
        assert_eq!(LeaseHolder::decode(b"junk"), None);
    }
}
