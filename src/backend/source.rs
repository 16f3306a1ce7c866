//! The backend factory's first half: which store a mount source names. `sqlite:PATH` is a
//! SQLite database file (`backend::sqlite`); `s3://BUCKET/PREFIX` a prefix of an S3 bucket
//! (`backend::s3`); anything else a backing directory (`backend::local`). `daemon` opens what
//! it names.

use std::path::{Path, PathBuf};

/// The prefix of a SQLite mount source.
pub const SQLITE_PREFIX: &str = "sqlite:";
/// The prefix of an S3 mount source.
pub const S3_PREFIX: &str = "s3://";

/// A prefix of an S3 bucket, as `s3://BUCKET/PREFIX` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Source {
    pub bucket: String,
    /// Without slashes at either end; empty for the whole bucket.
    pub prefix: String,
    /// `s3://BUCKET/PREFIX` as a path: the key of its runtime and default state directories
    /// (escaped, `s3:--BUCKET-PREFIX`), and what the mount table shows.
    key: PathBuf,
}

impl S3Source {
    /// `text` without `s3://`: BUCKET[/PREFIX]. The bucket as S3 names them (3 to 63 lower-case
    /// letters, digits, dots and hyphens); the prefix printable, without `//`, `.` or `..`
    /// pieces (they would not name one place in every server's key space).
    fn parse(text: &str) -> Result<S3Source, String> {
        let (bucket, prefix) = text.split_once('/').unwrap_or((text, ""));
        let prefix = prefix.trim_matches('/');
        let shown = format!("{S3_PREFIX}{text}");
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
            && bucket.as_bytes()[0].is_ascii_alphanumeric()
            && bucket.as_bytes()[bucket.len() - 1].is_ascii_alphanumeric();
        if !bucket_ok {
            return Err(format!(
                "{shown}: '{bucket}' is not a bucket name (3 to 63 lower-case letters, digits, dots and hyphens)"
            ));
        }
        if prefix.split('/').any(|p| (p.is_empty() && !prefix.is_empty()) || p == "." || p == "..")
            || prefix.bytes().any(|b| b.is_ascii_control() || b == b'\\')
            || prefix.len() > 512
        {
            return Err(format!("{shown}: '{prefix}' is not a usable prefix (no empty, '.' or '..' pieces)"));
        }
        let key = PathBuf::from(format!("{S3_PREFIX}{bucket}/{prefix}").trim_end_matches('/'));
        Ok(S3Source { bucket: bucket.to_owned(), prefix: prefix.to_owned(), key })
    }
}

impl S3Source {
    /// `s3://BUCKET/PREFIX`, for messages.
    pub fn path_shown(&self) -> String {
        self.key.display().to_string()
    }
}

/// Whether a runtime or state directory's name (`runtime::escape_path`) is an S3 source's:
/// its "backing directory" is a bucket, never found on this machine's file system.
pub fn is_s3_key_name(name: &str) -> bool {
    name.starts_with("s3:--")
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MountSource {
    /// A backing directory.
    Local(PathBuf),
    /// A SQLite database file (made if absent; its directory must exist).
    Sqlite(PathBuf),
    /// A prefix of an S3 bucket.
    S3(S3Source),
}

impl MountSource {
    /// What `source` names; an error only for an `s3://` source that names no bucket.
    pub fn parse(source: &Path) -> Result<MountSource, String> {
        let text = source.to_str();
        if let Some(path) = text.and_then(|s| s.strip_prefix(SQLITE_PREFIX)) {
            return Ok(MountSource::Sqlite(PathBuf::from(path)));
        }
        if let Some(rest) = text.and_then(|s| s.strip_prefix(S3_PREFIX)) {
            return S3Source::parse(rest).map(MountSource::S3);
        }
        Ok(MountSource::Local(source.to_path_buf()))
    }

    /// The backing directory, the database file, or an S3 source's key (`S3Source::key`):
    /// what the runtime and state directories are found by.
    pub fn path(&self) -> &Path {
        match self {
            MountSource::Local(path) | MountSource::Sqlite(path) => path,
            MountSource::S3(s3) => &s3.key,
        }
    }
}

/// The database path of a `sqlite:` source made absolute and canonical (its directory must
/// exist; the file itself may not yet): the key its runtime and state directories are found by.
pub fn check_database_path(path: &Path) -> Result<PathBuf, String> {
    let shown = path.display();
    if path.as_os_str().is_empty() {
        return Err(format!("{SQLITE_PREFIX}{shown}: expected a database file's path after '{SQLITE_PREFIX}'"));
    }
    let name = path.file_name().ok_or_else(|| format!("SQLite database {shown}: not a file's path"))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let dir = std::fs::canonicalize(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => {
            format!("SQLite database {shown}: its directory {} does not exist", dir.display())
        }
        _ => format!("SQLite database {shown}: its directory {}: {e}", dir.display()),
    })?;
    if !dir.is_dir() {
        return Err(format!("SQLite database {shown}: {} is not a directory", dir.display()));
    }
    let path = dir.join(name);
    if path.is_dir() {
        return Err(format!("SQLite database {shown} is a directory"));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sqlite_prefix_names_a_database_and_anything_else_a_directory() {
        assert_eq!(
            MountSource::parse(Path::new("sqlite:/var/lib/x.db")).unwrap(),
            MountSource::Sqlite("/var/lib/x.db".into())
        );
        assert_eq!(MountSource::parse(Path::new("/srv/data")).unwrap(), MountSource::Local("/srv/data".into()));
        assert!(check_database_path(Path::new("/no/such/dir/x.db")).unwrap_err().contains("does not exist"));
        assert!(check_database_path(Path::new("")).is_err());
    }

    #[test]
    fn an_s3_source_names_a_bucket_and_a_prefix_or_says_what_is_wrong() {
        let MountSource::S3(s3) = MountSource::parse(Path::new("s3://my-bucket/trees/a/")).unwrap() else {
            panic!("not s3")
        };
        assert_eq!((s3.bucket.as_str(), s3.prefix.as_str()), ("my-bucket", "trees/a"));
        assert_eq!(MountSource::S3(s3.clone()).path(), Path::new("s3://my-bucket/trees/a"));
        let escaped = crate::runtime::escape_path(MountSource::S3(s3).path());
        assert!(is_s3_key_name(&escaped), "{escaped}");
        let MountSource::S3(whole) = MountSource::parse(Path::new("s3://bkt")).unwrap() else { panic!("not s3") };
        assert_eq!(whole.prefix, "");
        for bad in ["s3://", "s3://Upper/x", "s3://ab/x", "s3://b_b/x", "s3://bkt/a//b", "s3://bkt/../x", "s3://-bk/x"]
        {
            let e = MountSource::parse(Path::new(bad)).unwrap_err();
            assert!(e.contains(bad.trim_end_matches('/')) || e.contains("s3://"), "{bad}: {e}");
        }
    }
}
