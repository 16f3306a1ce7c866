//! The command line as a user meets it: every subcommand's `--help`, bad usage, the version,
//! a closed pipe, the man page and completions. No mount, no root.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};

use common::*;

const SUBCOMMANDS: &[&str] =
    &["mount", "umount", "stats", "sync", "snapshot", "recover", "forget", "completions", "man"];

fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_subcommand_answers_help_with_its_usage() {
    for sub in SUBCOMMANDS {
        let out = coalescefs(&[sub, "--help"]);
        assert_eq!(out.status.code(), Some(0), "{sub} --help: {}", stderr_of(&out));
        let help = stdout_of(&out);
        assert!(help.contains(&format!("Usage: coalescefs {sub}")), "{sub} --help says:\n{help}");
        let short = coalescefs(&["help", sub]);
        assert_eq!(short.status.code(), Some(0), "help {sub}");
    }
    let top = coalescefs(&["--help"]);
    assert_eq!(top.status.code(), Some(0));
    let help = stdout_of(&top);
    for sub in SUBCOMMANDS {
        assert!(help.contains(sub), "--help lists {sub}:\n{help}");
    }
    assert!(help.contains("Exit codes"), "{help}");
    let mount = stdout_of(&coalescefs(&["mount", "--help"]));
    for option in ["log=on|off|PATH", "state=DIR", "unit=SIZE", "writeback_cache", "Examples:"] {
        assert!(mount.contains(option), "mount --help documents {option}:\n{mount}");
    }
}

#[test]
fn bad_usage_exits_2_with_the_usage_line() {
    for args in [
        &["mount", "/nonexistent"][..],
        &["mount", "a", "b", "--bogus"],
        &["umount"],
        &["umount", "--frob", "/mnt"],
        &["stats"],
        &["sync", "a", "b"],
        &["snapshot", "/mnt"],
        &["recover"],
        &["recover", "/srv", "--state", "/s", "--log", "/l"],
        &["completions", "tcsh"],
        &["frobnicate"],
    ] {
        let out = coalescefs(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr_of(&out));
        let said = stderr_of(&out);
        // The usage line, or for a bad value the values there are; and where to read more.
        assert!(said.contains("Usage: coalescefs") || said.contains("possible values"), "{args:?}: {said}");
        assert!(said.contains("try '--help'"), "{args:?}: {said}");
    }
    // No command at all: the whole help, as an error.
    let out = coalescefs(&[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("Usage: coalescefs <COMMAND>"), "{}", stderr_of(&out));
    // Options inside -o are checked by the mount's own parser, with the same exit code.
    let out = coalescefs(&["mount", "a", "b", "-o", "frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr_of(&out).contains("unknown mount option 'frobnicate'"), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("try '--help'"), "{}", stderr_of(&out));
}

#[test]
fn version_names_the_commit() {
    let out = coalescefs(&["--version"]);
    assert_eq!(out.status.code(), Some(0));
    let version = stdout_of(&out);
    assert!(version.starts_with(&format!("coalescefs {} (", env!("CARGO_PKG_VERSION"))), "{version}");
}

/// `coalescefs --help | head -0`: the reader is gone before a byte is written.
#[test]
fn a_closed_pipe_is_no_panic() {
    for args in [&["--help"][..], &["man"], &["completions", "bash"], &["mount", "--help"]] {
        let mut child = Command::new(BIN).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take());
        let mut stderr = String::new();
        child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn the_man_page_and_completions_come_from_the_same_definitions() {
    let man = stdout_of(&coalescefs(&["man"]));
    assert!(man.starts_with(".ie") || man.contains(".TH coalescefs 1"), "{man}");
    for sub in ["COALESCEFS MOUNT", "COALESCEFS RECOVER", "state=DIR"] {
        assert!(man.contains(sub), "the man page has {sub}");
    }
    for shell in ["bash", "zsh", "fish"] {
        let out = coalescefs(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0));
        let script = stdout_of(&out);
        assert!(script.contains("coalescefs") && script.contains("recover"), "{shell}: {script}");
    }
    // Rendered by man(1) where it is installed: the page is valid roff.
    if Command::new("man").arg("--version").output().is_ok_and(|o| o.status.success()) {
        let page =
            Command::new("sh").args(["-c", &format!("{BIN} man | man -l -")]).env("MANPAGER", "cat").output().unwrap();
        assert!(page.status.success(), "{}", stderr_of(&page));
        assert!(stdout_of(&page).contains("coalescefs mount"), "{}", stdout_of(&page));
    } else {
        skip(
            "the_man_page_and_completions_come_from_the_same_definitions",
            "the man page's rendering: man(1) is not installed",
        );
    }
}
