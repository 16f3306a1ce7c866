//! The backend factory's first half: which store a mount source names. `sqlite:PATH` is a
//! SQLite database file (`backend::sqlite`); anything else a backing directory
//! (`backend::local`). `daemon` opens what it names.

use std::path::{Path, PathBuf};

/// The prefix of a SQLite mount source.
pub const SQLITE_PREFIX: &str = "sqlite:";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MountSource {
    /// A backing directory.
    Local(PathBuf),
    /// A SQLite database file (made if absent; its directory must exist).
    Sqlite(PathBuf),
}

impl MountSource {
    pub fn parse(source: &Path) -> MountSource {
        match source.to_str().and_then(|s| s.strip_prefix(SQLITE_PREFIX)) {
            Some(path) => MountSource::Sqlite(PathBuf::from(path)),
            None => MountSource::Local(source.to_path_buf()),
        }
    }

    /// The backing directory or the database file.
    pub fn path(&self) -> &Path {
        match self {
            MountSource::Local(path) | MountSource::Sqlite(path) => path,
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
        assert_eq!(MountSource::parse(Path::new("sqlite:/var/lib/x.db")), MountSource::Sqlite("/var/lib/x.db".into()));
        assert_eq!(MountSource::parse(Path::new("/srv/data")), MountSource::Local("/srv/data".into()));
        assert!(check_database_path(Path::new("/no/such/dir/x.db")).unwrap_err().contains("does not exist"));
        assert!(check_database_path(Path::new("")).is_err());
    }
}
