//! Every bad input gets a clear message and a non-zero exit status, and changes nothing.

mod common;

use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn assert_fails(out: &std::process::Output, code: i32, message: &str) {
    assert_eq!(out.status.code(), Some(code), "stderr: {}", stderr_of(out));
    assert!(stderr_of(out).contains(message), "expected {message:?} in: {}", stderr_of(out));
}

/// A temporary directory holding `backing` and `mnt`; the backing's state and runtime
/// directories go with it.
struct Scratch {
    dir: tempfile::TempDir,
    _state: StateCleanup,
}

impl Scratch {
    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }
}

fn dirs() -> (Scratch, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let b = dir.path().join("backing");
    let m = dir.path().join("mnt");
    fs::create_dir(&b).unwrap();
    fs::create_dir(&m).unwrap();
    let state = StateCleanup::of(&b);
    (Scratch { dir, _state: state }, path_str(&b), path_str(&m))
}

fn is_mounted(path: &str) -> bool {
    fs::read_to_string("/proc/self/mountinfo").unwrap().lines().any(|l| l.split(' ').nth(4) == Some(path))
}

#[test]
fn missing_backing_directory() {
    let (t, _, m) = dirs();
    let missing = path_str(&t.path().join("nope"));
    assert_fails(&coalescefs(&["mount", &missing, &m]), 1, &format!("backing directory {missing} does not exist"));
    assert!(!is_mounted(&m));
}

#[test]
fn backing_directory_that_is_a_file() {
    let (t, _, m) = dirs();
    let file = t.path().join("file");
    fs::write(&file, b"x").unwrap();
    assert_fails(&coalescefs(&["mount", &path_str(&file), &m]), 1, "is not a directory");
}

#[test]
fn missing_mount_point() {
    let (t, b, _) = dirs();
    let missing = path_str(&t.path().join("nomnt"));
    assert_fails(&coalescefs(&["mount", &b, &missing]), 1, &format!("mount point {missing} does not exist"));
}

#[test]
fn busy_mount_point() {
    let m = TestMount::new();
    let other = tempfile::tempdir().unwrap();
    let out = coalescefs(&["mount", &path_str(other.path()), &path_str(&m.mnt)]);
    assert_fails(&out, 1, "is busy: fuse.coalescefs from");
}

#[test]
fn unknown_option_and_bad_values() {
    let (_t, b, m) = dirs();
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "allow_other,frobnicate"]),
        2,
        "unknown mount option 'frobnicate'",
    );
    assert_fails(&coalescefs(&["mount", &b, &m, "-o", "threads=0"]), 2, "threads=0: expected a whole number");
    assert_fails(&coalescefs(&["mount", &b, &m, "-o", "unit=3M"]), 2, "must be a power of two from 4K to 64M");
    assert_fails(&coalescefs(&["mount", &b, &m, "-o", "backend=s3"]), 2, "backend=s3: expected local or null");
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "max_write=5000"]),
        2,
        "max_write=5000: expected a multiple of 4 KiB",
    );
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "max_write=32M"]),
        2,
        "max_write=32M: expected a multiple of 4 KiB",
    );
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "log=somewhere"]),
        2,
        "log=somewhere: expected on, off or an absolute path",
    );
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "log=on,log_size=100K"]),
        2,
        "log_size=100K: expected at least 1M",
    );
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "checkpoint_interval=0s"]),
        2,
        "checkpoint_interval=0s: must be more than 0",
    );
    assert_fails(
        &coalescefs(&["mount", &b, &m, "-o", "checkpoint_idle=soon"]),
        2,
        "checkpoint_idle=soon: 'soon' is not a duration",
    );
    assert_fails(&coalescefs(&["mount", &b, &m, "-o", "state=rel/dir"]), 2, "state=rel/dir: expected an absolute path");
    let inside = format!("log=on,state={b}/state");
    assert_fails(&coalescefs(&["mount", &b, &m, "-o", &inside]), 1, "inside the backing directory");
    assert_fails(&coalescefs(&["mount", &b, &m, "--bogus"]), 2, "unexpected argument '--bogus'");
    assert_fails(&coalescefs(&["mount", &b]), 2, "<MOUNTPOINT>");
    assert_fails(&coalescefs(&["frobnicate"]), 2, "unrecognized subcommand 'frobnicate'");
    assert!(!is_mounted(&m));
    assert!(fs::read_dir(&b).unwrap().next().is_none(), "a refused mount leaves the backing dir untouched");
}

#[test]
fn unwritable_backing_directory() {
    // A read-only bind mount: unwritable even for root.
    let (t, b, m) = dirs();
    let ro = t.path().join("ro");
    fs::create_dir(&ro).unwrap();
    let _ro_state = StateCleanup::of(&ro);
    let ro = path_str(&ro);
    assert!(Command::new("mount").args(["--bind", &b, &ro]).status().unwrap().success());
    assert!(Command::new("mount").args(["-o", "remount,bind,ro", &ro]).status().unwrap().success());
    let out = coalescefs(&["mount", &ro, &m]);
    let ro_mounted = coalescefs(&["mount", &ro, &m, "-o", "ro"]);
    let listing_works = fs::read_dir(&m).is_ok();
    let _ = coalescefs(&["umount", &m]);
    let _ = Command::new("umount").arg(&ro).status();
    assert_fails(&out, 1, "is not writable");
    assert!(stderr_of(&out).contains("-o ro"), "the message says how to serve it anyway");
    assert!(ro_mounted.status.success(), "-o ro serves a read-only backing dir: {}", stderr_of(&ro_mounted));
    assert!(listing_works);
}

#[test]
fn backing_directory_already_mounted_elsewhere() {
    let m = TestMount::new();
    let other_mnt = tempfile::tempdir().unwrap();
    let out = coalescefs(&["mount", &path_str(&m.backing), &path_str(other_mnt.path())]);
    assert_fails(&out, 1, "is already mounted by another coalescefs at");
    assert!(!is_mounted(&path_str(other_mnt.path())));
}

/// One state directory keeps one backing directory's log: a second backing directory given
/// the same `state=` is refused while the first is mounted.
#[test]
fn a_state_directory_in_use_is_refused() {
    let state = tempfile::tempdir().unwrap();
    let option = format!("log=on,state={}", path_str(&state.path().join("s")));
    let _first = TestMount::with_options(&[&option]);
    let (_t, b, m) = dirs();
    assert_fails(&coalescefs(&["mount", &b, &m, "-o", &option]), 1, "is in use by another coalescefs");
    assert!(!is_mounted(&m));
}

#[test]
fn mount_point_inside_the_backing_directory() {
    let (_t, b, _) = dirs();
    let inner = format!("{b}/inner");
    fs::create_dir(&inner).unwrap();
    assert_fails(&coalescefs(&["mount", &b, &inner]), 1, "is inside the backing directory");
}

#[test]
fn umount_of_something_not_mounted() {
    let (_t, _, m) = dirs();
    assert_fails(&coalescefs(&["umount", &m]), 1, "is not mounted");
    assert_fails(&coalescefs(&["umount", "/proc"]), 1, "is a proc mount, not coalescefs");
}

fn daemon_pid(backing: &std::path::Path) -> i32 {
    fs::read_to_string(runtime_dir(backing).join("pid"))
        .unwrap()
        .trim_end()
        .parse()
        .expect("the pid file holds one number")
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_daemon_leaves_a_mount_that_umount_clears() {
    let mut m = TestMount::new();
    let mnt = path_str(&m.mnt);
    fs::write(m.path("f"), b"kept").unwrap();
    let pid = daemon_pid(&m.backing);
    // SAFETY: `kill` takes only a pid and a signal number; it touches none of our memory.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the daemon to die", || process_gone(pid));
    // A dead daemon's mount answers ENOTCONN, or ECONNABORTED once the kernel has aborted
    // the connection.
    let dead = fs::metadata(&m.mnt).unwrap_err().raw_os_error();
    assert!(matches!(dead, Some(libc::ENOTCONN | libc::ECONNABORTED)), "{dead:?}");
    // A new mount there is refused with a pointer to the fix.
    let again = coalescefs(&["mount", &path_str(&m.backing), &mnt]);
    assert_fails(&again, 1, "coalescefs umount");
    let out = coalescefs(&["umount", &mnt]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(!is_mounted(&mnt));
    // And the backing dir can be mounted again: the dead daemon's lock went with it. What close
    // acknowledged is there (with the intent log, the default, replayed from it).
    let out = coalescefs(&["mount", &path_str(&m.backing), &mnt]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert_eq!(fs::read(m.path("f")).unwrap(), b"kept");
    assert!(coalescefs(&["umount", &mnt]).status.success());
    m.assume_unmounted();
}

#[test]
fn sigterm_and_sigint_unmount_cleanly() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut m = TestMount::new();
        let mnt = path_str(&m.mnt);
        let pid = daemon_pid(&m.backing);
        // SAFETY: `kill` takes only a pid and a signal number; it touches none of our memory.
        unsafe { libc::kill(pid, signal) };
        wait_until("the daemon to exit", || process_gone(pid));
        assert!(!is_mounted(&mnt), "signal {signal} left the mount behind");
        assert!(!m.runtime_dir().join("pid").exists(), "the daemon removes its pid file on a clean exit");
        assert!(!m.runtime_dir().join("control.sock").exists(), "and its control socket");
        m.assume_unmounted();
    }
}

/// By default the daemon stays in the session of whoever mounts (sharing the scheduling group of
/// the programs started there under the kernel's autogroups), in a process group of its own;
/// with `session=own` it leads a session of its own. Either way the terminal's job control never
/// reaches it: a hangup of the terminal it was mounted from leaves both mounts served.
#[test]
fn the_daemon_stays_in_the_session_asked_for_and_outlives_a_hangup_of_its_terminal() {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;

    let (_t, b, m) = dirs();
    let (_t2, own_b, own_m) = dirs();
    // Opened close-on-exec: a copy of the master in any child (the tests' others, the daemon)
    // would keep the terminal from hanging up.
    // SAFETY: posix_openpt, grantpt, unlockpt and ptsname_r take a descriptor, flags and a live
    // buffer of the length given; open reads a NUL-terminated string that outlives the call.
    let ends = unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        let mut name = [0 as libc::c_char; 128];
        if master < 0
            || libc::grantpt(master) != 0
            || libc::unlockpt(master) != 0
            || libc::ptsname_r(master, name.as_mut_ptr(), name.len()) != 0
        {
            None
        } else {
            let slave = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
            (slave >= 0).then_some((master, slave))
        }
    };
    let Some((master, slave)) = ends else {
        return skip(
            "the_daemon_stays_in_the_session_asked_for_and_outlives_a_hangup_of_its_terminal",
            &format!("no pseudo-terminal: {}", std::io::Error::last_os_error()),
        );
    };
    // SAFETY: both descriptors were just opened here and are owned by nothing else.
    let (master, slave) = unsafe { (fs::File::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    // A login's shape: a session leader whose controlling terminal is the pty mounts, then
    // becomes a program waiting in the foreground.
    let script = format!(
        "'{BIN}' mount '{own_b}' '{own_m}' -o session=own && '{BIN}' mount '{b}' '{m}' && echo mounted; exec sleep 600"
    );
    let mut command = Command::new("sh");
    command
        .args(["-c", &script])
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave.try_clone().unwrap());
    // SAFETY: signal, setsid and ioctl are async-signal-safe and touch only the child's own state.
    unsafe {
        command.pre_exec(|| {
            // The hangup's default action, whatever this process inherited (under nohup SIGHUP
            // is ignored, and so would be the leader's hangup and the daemon's alike).
            if libc::signal(libc::SIGHUP, libc::SIG_DFL) == libc::SIG_ERR
                || libc::setsid() < 0
                || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut leader = command.spawn().unwrap();
    drop(slave);
    let (said, heard) = std::sync::mpsc::channel();
    let mut reader = master.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut output = Vec::new();
        let mut chunk = [0u8; 512];
        while let Ok(n @ 1..) = reader.read(&mut chunk) {
            output.extend_from_slice(&chunk[..n]);
            if String::from_utf8_lossy(&output).contains("mounted\r\n") {
                break;
            }
        }
        let _ = said.send(String::from_utf8_lossy(&output).into_owned());
    });
    let output = heard.recv_timeout(Duration::from_secs(30)).expect("the mount answers within 30 s");
    assert!(output.contains("mounted"), "the mount failed: {output}");
    assert!(is_mounted(&m) && is_mounted(&own_m));
    let daemon = daemon_pid(std::path::Path::new(&b));
    let own_daemon = daemon_pid(std::path::Path::new(&own_b));
    // SAFETY: getsid and getpgid take a pid and read no memory of ours.
    let (session, group, own_session) =
        unsafe { (libc::getsid(daemon), libc::getpgid(daemon), libc::getsid(own_daemon)) };
    assert_eq!(session, leader.id() as i32, "by default the daemon is in the session it was mounted from");
    assert_eq!(group, daemon, "the daemon leads a process group of its own");
    assert_eq!(own_session, own_daemon, "session=own: the daemon leads a session of its own");

    // The hangup: the terminal's last open descriptor closes, and the kernel sends SIGHUP to the
    // session's leader, then (as it exits) to the terminal's foreground process group.
    drop(master);
    wait_until("the session's leader to die of the hangup", || leader.try_wait().unwrap().is_some());
    std::thread::sleep(Duration::from_millis(200));
    for mnt in [&m, &own_m] {
        assert!(is_mounted(mnt), "a hangup of the terminal unmounted {mnt}");
        fs::write(format!("{mnt}/f"), b"after the hangup").unwrap();
        assert_eq!(fs::read(format!("{mnt}/f")).unwrap(), b"after the hangup");
        let out = coalescefs(&["umount", mnt]);
        assert!(out.status.success(), "{}", stderr_of(&out));
    }
}

#[test]
fn umount_of_a_busy_mount_says_so_and_lazy_clears_it() {
    let mut m = TestMount::new();
    let mnt = path_str(&m.mnt);
    let held = fs::File::open(m.path(".")).unwrap();
    let out = coalescefs(&["umount", &mnt]);
    assert_fails(&out, 1, "is busy");
    assert!(is_mounted(&mnt));
    let out = coalescefs(&["umount", "--lazy", &mnt]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(!is_mounted(&mnt));
    drop(held);
    m.assume_unmounted();
}

#[test]
fn helper_form_used_by_mount_fuse3() {
    if Command::new("mount.fuse3").arg("--version").output().is_err() {
        return skip("helper_form_used_by_mount_fuse3", "no mount.fuse3 (scripts/deps installs fuse3)");
    }
    let (_t, b, m) = dirs();
    // `mount -t fuse.coalescefs B M -o ...` runs this helper, which runs `coalescefs B M -o ...`
    // from PATH (mount(8) itself resets PATH, so there the binary must be installed).
    let out = Command::new("mount.fuse3")
        .args([&b, &m, "-t", "coalescefs", "-o", "allow_other,noatime,nofail"])
        .env(
            "PATH",
            format!("{}:{}", std::path::Path::new(BIN).parent().unwrap().display(), std::env::var("PATH").unwrap()),
        )
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(is_mounted(&m));
    fs::write(format!("{m}/f"), b"via mount(8)").unwrap();
    assert!(coalescefs(&["umount", &m]).status.success());
    assert_eq!(fs::read(format!("{b}/f")).unwrap(), b"via mount(8)");
}

/// A start that fails after it made its state (the metrics port taken: found before anything
/// is made; the intent log failing its first write: after the log, its marker on the backing
/// root and the state directory were made) leaves nothing behind: no crash marker, no log, no
/// state directory, no socket or pid file; and the next mount, with the log off, starts.
#[test]
fn a_start_that_fails_undoes_everything_it_made() {
    // SAFETY: geteuid takes no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        skip("a_start_that_fails_undoes_everything_it_made", "the state and runtime directories checked are root's");
        return;
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metrics = format!("metrics={}", taken.local_addr().unwrap());
    /// Options, the daemon's environment, and what the failure says.
    type Failure<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let failures: [Failure; 2] =
        [(&["-o", &metrics], &[], "cannot listen"), (&[], &[("COALESCEFS_FAULTS", "logwrite=EIO")], "cannot start on")];
    for (options, env, message) in failures {
        let (_t, b, m) = dirs();
        let backing = std::path::Path::new(&b);
        let out = Command::new(BIN).args(["mount", &b, &m]).args(options).envs(env.iter().copied()).output().unwrap();
        assert_fails(&out, 1, message);
        assert!(!is_mounted(&m));
        assert_eq!(xattr_of(backing, "user.coalescefs.log"), Err(libc::ENODATA), "{message}: a crash marker left");
        assert!(!state_dir(backing).exists(), "{message}: the state directory left");
        for file in ["pid", "control.sock"] {
            assert!(!runtime_dir(backing).join(file).exists(), "{message}: {file} left");
        }
        let out = coalescefs(&["mount", &b, &m, "-o", "log=off"]);
        assert!(out.status.success(), "{message}: the next mount: {}", stderr_of(&out));
        assert!(coalescefs(&["umount", &m]).status.success());
    }
}

/// What a new user read and found wrong: a non-empty mount point taken silently, a path that
/// does not exist called "not mounted", the daemon's log saying "shut down" twice and
/// "replayed 41 of 64 records" (as if 23 were lost) after a crash.
#[test]
fn what_the_commands_say_is_what_happened() {
    let (t, b, m) = dirs();
    let missing = path_str(&t.path().join("nope"));
    for command in ["stats", "umount", "sync"] {
        assert_fails(&coalescefs(&[command, &missing]), 1, &format!("{missing} does not exist"));
    }
    fs::write(format!("{m}/hidden"), b"x").unwrap();
    let out = coalescefs(&["mount", &b, &m]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("is not empty (hidden among its entries)"), "{}", stderr_of(&out));
    let file = format!("{m}/f");
    let mut f = fs::File::create(&file).unwrap();
    std::io::Write::write_all(&mut f, b"fsynced").unwrap();
    f.sync_all().unwrap();
    let pid = daemon_pid(std::path::Path::new(&b));
    kill_and_wait(pid);
    drop(f);
    assert!(coalescefs(&["umount", &m]).status.success());
    let out = coalescefs(&["mount", &b, &m]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(coalescefs(&["umount", &m]).status.success());
    let log = fs::read_to_string(runtime_dir(std::path::Path::new(&b)).join("daemon.log")).unwrap();
    let this_daemon = |line: &&str| !line.contains(&format!("[{pid}]"));
    let replay = log.lines().find(|l| l.contains("replayed the intent log")).unwrap_or_else(|| panic!("{log}"));
    assert!(replay.contains(" applied, ") && replay.contains("already on the backend"), "{replay}");
    let shut_down = log.lines().filter(this_daemon).filter(|l| l.contains("shut down with")).count();
    assert_eq!(shut_down, 1, "the second daemon said it shut down {shut_down} times:\n{log}");
}
