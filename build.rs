//! Puts the commit the binary was built from into `--version` (git describe, when the source
//! is a git checkout, with "-dirty" where tracked files differ from it; "unknown commit"
//! otherwise, as from a source package).

use std::process::Command;

/// `git ARGS`' output, without writing anything: `git describe --dirty` would refresh the index
/// and write it back, which the rerun-if-changed below takes for a change, so the next cargo
/// command would run this again and build the crate anew (52 s of CI's package step, after
/// `cargo test`). `git status` honours GIT_OPTIONAL_LOCKS; `describe --dirty` does not.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).env("GIT_OPTIONAL_LOCKS", "0").output().ok()?;
    out.status.success().then(|| String::from_utf8(out.stdout).ok()).flatten().map(|s| s.trim().to_string())
}

fn main() {
    let commit = git(&["describe", "--always", "--abbrev=12"])
        .filter(|s| !s.is_empty())
        .map(|describe| match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(changes) if !changes.is_empty() => format!("{describe}-dirty"),
            _ => describe,
        })
        .unwrap_or_else(|| "unknown commit".to_string());
    println!("cargo:rustc-env=COALESCEFS_COMMIT={commit}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/index");
}
