//! Where the S3 backend's objects are in the bucket, and what the small ones say: the names
//! of unit objects, checkpoint manifests and the writer's lease, and the bytes of a manifest
//! and a lease. Owns no I/O (`store` and `lease` put and get them).
//!
//! ```text
//! PREFIX/units/<file id>/<unit index>.<generation>   a unit's bytes, written whole, never overwritten
//! PREFIX/segments/<id>                               pieces of many units, packed (`segments`)
//! PREFIX/manifests/<seq>                              a checkpoint: header + the namespace database,
//!                                                    or the pages where it differs from an earlier one
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

/// The first line of every manifest this build writes: the format and its version. Version 1
/// (a whole database only) is still read.
const MANIFEST_MAGIC: &str = "coalescefs-s3-manifest 2";
const MANIFEST_MAGIC_V1: &str = "coalescefs-s3-manifest 1";
/// The most a manifest's header may take; a reader fetches this much first.
pub const MANIFEST_HEADER_MAX: usize = 4096;

/// What a manifest carries of the namespace database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    /// The whole database.
    Whole(Vec<u8>),
    /// The pages (index from 0, bytes) where the database differs from manifest `base`'s;
    /// the database they make is `database_bytes` long, its crc32c `database_crc32c`.
    Pages { base: u64, page_bytes: u32, database_bytes: u64, database_crc32c: u32, pages: Vec<(u32, Vec<u8>)> },
}

/// A checkpoint manifest: a text header (the magic line, `key=value` lines, a blank line)
/// followed by the namespace database's bytes, or by the pages where it differs from an
/// earlier manifest's (`base=`): entries of a little-endian u32 page index and the page.
/// The header gives the database's length and crc32c either way, and a page list's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub seq: u64,
    /// The lease id of the mount that wrote it.
    pub writer: String,
    pub unit_bytes: u64,
    pub content: Content,
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut header = String::new();
        let _ = writeln!(header, "{MANIFEST_MAGIC}");
        let _ = writeln!(header, "seq={}", self.seq);
        let _ = writeln!(header, "writer={}", self.writer);
        let _ = writeln!(header, "unit_bytes={}", self.unit_bytes);
        let page_list;
        let body: &[u8] = match &self.content {
            Content::Whole(database) => {
                let _ = writeln!(header, "database_bytes={}", database.len());
                let _ = writeln!(header, "database_crc32c={:08x}", crc32c::crc32c(database));
                database
            }
            Content::Pages { base, page_bytes, database_bytes, database_crc32c, pages } => {
                assert!(*base < self.seq, "manifest {} over a later base {base}", self.seq);
                let mut body = Vec::with_capacity(pages.len() * (4 + *page_bytes as usize));
                for (index, page) in pages {
                    assert_eq!(page.len(), *page_bytes as usize, "page {index} of manifest {}", self.seq);
                    assert!(
                        (u64::from(*index) + 1) * u64::from(*page_bytes) <= *database_bytes,
                        "page {index} past the database's end"
                    );
                    body.extend_from_slice(&index.to_le_bytes());
                    body.extend_from_slice(page);
                }
                let _ = writeln!(header, "database_bytes={database_bytes}");
                let _ = writeln!(header, "database_crc32c={database_crc32c:08x}");
                let _ = writeln!(header, "base={base}");
                let _ = writeln!(header, "page_bytes={page_bytes}");
                let _ = writeln!(header, "pages={}", pages.len());
                let _ = writeln!(header, "pages_crc32c={:08x}", crc32c::crc32c(&body));
                page_list = body;
                &page_list
            }
        };
        header.push('\n');
        assert!(header.len() <= MANIFEST_HEADER_MAX, "a manifest header of {} bytes", header.len());
        let mut out = header.into_bytes();
        out.extend_from_slice(body);
        out
    }

    /// The manifest in `bytes`, checked whole (lengths and checksums): an error says what is
    /// wrong, for the person whose mount it stops.
    pub fn decode(bytes: &[u8]) -> Result<Manifest, String> {
        let end = bytes
            .windows(2)
            .take(MANIFEST_HEADER_MAX)
            .position(|w| w == b"\n\n")
            .ok_or("no header (not a coalescefs manifest)")?;
        let header = std::str::from_utf8(&bytes[..end]).map_err(|_| "a header that is not text")?;
        let mut lines = header.lines();
        let magic = lines.next();
        if magic != Some(MANIFEST_MAGIC) && magic != Some(MANIFEST_MAGIC_V1) {
            return Err(format!("not a manifest of a version this build reads (expected '{MANIFEST_MAGIC}')"));
        }
        let mut fields = std::collections::HashMap::new();
        for line in lines {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("a header line without '=': {line}"))?;
            fields.insert(k, v);
        }
        let field = |k: &str| fields.get(k).copied().ok_or_else(|| format!("no {k} in the header"));
        let number = |k: &str| field(k)?.parse::<u64>().map_err(|_| format!("{k} is not a number"));
        let checksum = |k: &str| u32::from_str_radix(field(k)?, 16).map_err(|_| format!("{k} is not hex"));
        let body = &bytes[end + 2..];
        let content = if fields.contains_key("base") {
            let page_bytes = u32::try_from(number("page_bytes")?)
                .ok()
                .filter(|p| p.is_power_of_two() && *p >= 512)
                .ok_or("page_bytes is not a page size")?;
            let count = number("pages")?;
            let entry = 4 + u64::from(page_bytes);
            if body.len() as u64 != count.saturating_mul(entry) {
                return Err(format!("{} bytes of pages where the header says {count} of {page_bytes}", body.len()));
            }
            if crc32c::crc32c(body) != checksum("pages_crc32c")? {
                return Err("the pages' checksum does not match (a damaged manifest)".into());
            }
            let database_bytes = number("database_bytes")?;
            let mut pages = Vec::with_capacity(count as usize);
            for chunk in body.chunks_exact(entry as usize) {
                let index = u32::from_le_bytes(chunk[..4].try_into().expect("four bytes"));
                if (u64::from(index) + 1) * u64::from(page_bytes) > database_bytes {
                    return Err(format!("page {index} lies past the database's {database_bytes} bytes"));
                }
                pages.push((index, chunk[4..].to_vec()));
            }
            let base = number("base")?;
            if base >= number("seq")? {
                return Err(format!("a base ({base}) that is not older than the manifest"));
            }
            Content::Pages { base, page_bytes, database_bytes, database_crc32c: checksum("database_crc32c")?, pages }
        } else {
            if body.len() as u64 != number("database_bytes")? {
                return Err(format!(
                    "{} database bytes where the header says {}",
                    body.len(),
                    field("database_bytes")?
                ));
            }
            if crc32c::crc32c(body) != checksum("database_crc32c")? {
                return Err("the database's checksum does not match (a damaged manifest)".into());
            }
            Content::Whole(body.to_vec())
        };
        Ok(Manifest {
            seq: number("seq")?,
            writer: field("writer")?.to_owned(),
            unit_bytes: number("unit_bytes")?,
            content,
        })
    }

    /// The manifest this one's pages apply over; None for a whole database.
    pub fn base(&self) -> Option<u64> {
        match self.content {
            Content::Whole(_) => None,
            Content::Pages { base, .. } => Some(base),
        }
    }

    /// The database this manifest names: its own bytes, or its pages put over `base`'s
    /// database (the one `base()` names), checked against the length and crc32c it gives.
    pub fn into_database(self, base: Option<Vec<u8>>) -> Result<Vec<u8>, String> {
        match self.content {
            Content::Whole(database) => Ok(database),
            Content::Pages { base: base_seq, page_bytes, database_bytes, database_crc32c, pages } => {
                let mut database =
                    base.ok_or_else(|| format!("manifest {}: no database {base_seq} to apply to", self.seq))?;
                // The header is not under a checksum: its length is bounded before it sizes
                // anything. A database grows only by pages the list carries.
                let most = database.len() as u64 + pages.len() as u64 * u64::from(page_bytes);
                if database_bytes > most {
                    return Err(format!(
                        "manifest {} names a database of {database_bytes} bytes, more than its {} pages over \
                         manifest {base_seq}'s {} bytes make",
                        self.seq,
                        pages.len(),
                        database.len()
                    ));
                }
                database.resize(usize::try_from(database_bytes).map_err(|_| "a database too large here")?, 0);
                for (index, page) in pages {
                    let start = index as usize * page_bytes as usize;
                    database[start..start + page.len()].copy_from_slice(&page);
                }
                if crc32c::crc32c(&database) != database_crc32c {
                    return Err(format!(
                        "manifest {}'s pages over manifest {base_seq} do not make the database it names (checksum)",
                        self.seq
                    ));
                }
                Ok(database)
            }
        }
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

    fn whole(seq: u64, database: &[u8]) -> Manifest {
        Manifest { seq, writer: "abc".into(), unit_bytes: 1 << 20, content: Content::Whole(database.to_vec()) }
    }

    #[test]
    fn a_manifest_reads_back_whole_and_a_damaged_one_is_refused() {
        let m = whole(7, b"SQLite format 3\0...");
        let bytes = m.encode();
        assert_eq!(Manifest::decode(&bytes).unwrap(), m);
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(Manifest::decode(&bad).unwrap_err().contains("checksum"));
        assert!(Manifest::decode(&bytes[..bytes.len() - 1]).unwrap_err().contains("database bytes"));
        assert!(Manifest::decode(b"hello\n\nworld").is_err());
        // What earlier builds wrote (version 1: a whole database) still reads.
        let v1 = String::from_utf8(bytes).unwrap().replacen(MANIFEST_MAGIC, MANIFEST_MAGIC_V1, 1);
        assert_eq!(Manifest::decode(v1.as_bytes()).unwrap(), m);
    }

    #[test]
    fn a_manifest_of_pages_makes_the_database_over_its_base_and_checks_what_it_makes() {
        let page = 512usize;
        let old: Vec<u8> = (0..3 * page).map(|i| (i % 251) as u8).collect();
        let mut new = old.clone();
        new[page..2 * page].fill(7);
        new.extend(std::iter::repeat_n(9u8, page)); // grown by a page
        let pages = vec![(1u32, new[page..2 * page].to_vec()), (3, new[3 * page..].to_vec())];
        let m = Manifest {
            seq: 8,
            writer: "abc".into(),
            unit_bytes: 1 << 20,
            content: Content::Pages {
                base: 7,
                page_bytes: page as u32,
                database_bytes: new.len() as u64,
                database_crc32c: crc32c::crc32c(&new),
                pages,
            },
        };
        let bytes = m.encode();
        let read = Manifest::decode(&bytes).unwrap();
        assert_eq!(read, m);
        assert_eq!(read.base(), Some(7));
        assert_eq!(read.clone().into_database(Some(old.clone())).unwrap(), new);
        assert!(read.clone().into_database(None).unwrap_err().contains("no database 7"));
        let mut other_base = old.clone();
        other_base[0] ^= 1;
        assert!(read.into_database(Some(other_base)).unwrap_err().contains("checksum"), "applied over the wrong base");
        // A shorter database: the pages past its end go with the cut.
        let shrunk = Manifest {
            seq: 9,
            writer: "abc".into(),
            unit_bytes: 1 << 20,
            content: Content::Pages {
                base: 8,
                page_bytes: page as u32,
                database_bytes: page as u64,
                database_crc32c: crc32c::crc32c(&new[..page]),
                pages: Vec::new(),
            },
        };
        assert_eq!(Manifest::decode(&shrunk.encode()).unwrap().into_database(Some(new.clone())).unwrap(), &new[..page]);
        // A length in the header (no checksum covers it) past what the pages can make is
        // refused before it sizes anything.
        let mut huge = shrunk.clone();
        if let Content::Pages { database_bytes, .. } = &mut huge.content {
            *database_bytes = 1 << 40;
        }
        assert!(Manifest::decode(&huge.encode())
            .unwrap()
            .into_database(Some(new.clone()))
            .unwrap_err()
            .contains("more than"));
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert!(Manifest::decode(&bad).unwrap_err().contains("pages' checksum"));
        assert!(Manifest::decode(&bytes[..bytes.len() - 1]).unwrap_err().contains("bytes of pages"));
    }

    #[test]
    fn a_lease_reads_back() {
        let l = LeaseHolder { id: "x1".into(), host: "h".into(), state_dir: "/s".into(), pid: 4, since: 99 };
        assert_eq!(LeaseHolder::decode(&l.encode()), Some(l));
        assert_eq!(LeaseHolder::decode(b"junk"), None);
    }
}
