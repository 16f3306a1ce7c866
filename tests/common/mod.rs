//! A real coalescefs mount for integration tests: the built binary, mounted as a user would
//! (`coalescefs mount`, which returns once the mount answers), unmounted on drop.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod kernel_parameter;
#[allow(unused_imports)] // only the io_uring tests and those of requests above 1 MiB set one
pub use kernel_parameter::KernelParameter;
pub mod s3;
mod skip;
#[allow(unused_imports)] // not every test binary has a test that can skip
pub use skip::skip;

pub const BIN: &str = env!("CARGO_BIN_EXE_coalescefs");

pub fn coalescefs(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run coalescefs")
}

pub fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Whether this process should run the body of test `name`; when not, it has just run it in a
/// test process of its own and checked that it passed. Other tests in one process start
/// children, which hold copies of every open descriptor until their exec closes them, and the
/// file system sees each such close (FUSE FLUSH: buffered units flushed early, flush failures
/// retried and reported to nobody). Tests that count flushes or failures exactly run alone.
pub fn in_a_process_of_its_own(name: &str) -> bool {
    const ALONE: &str = "COALESCEFS_TEST_ALONE";
    if std::env::var_os(ALONE).is_some() {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1"])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("1 passed"), "{stdout}{}", stderr_of(&out));
    false
}

/// The bytes an unprivileged writer may still take on the file system `path` is on.
pub fn available_bytes(path: &Path) -> u64 {
    let st = statvfs_of(path);
    st.f_bavail * st.f_frsize
}

/// statvfs(3) of the file system `path` is on.
pub fn statvfs_of(path: &Path) -> libc::statvfs {
    let c = cstr(path);
    // SAFETY: the libc struct is plain integers (and arrays of them), for which all-zero bytes are
    // a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `statvfs` writes one value of the type its out-pointer has, into a live local
    // borrowed exclusively for the call; any C string passed is NUL-terminated.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &raw mut st) }, 0, "statvfs of {path:?}");
    st
}

/// Polls `done` until it holds; panics naming `what` after 10 s.
pub fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

pub struct TestMount {
    _dir: tempfile::TempDir,
    pub backing: PathBuf,
    pub mnt: PathBuf,
    options: Vec<String>,
    env: Vec<(String, String)>,
    /// RLIMIT_NOFILE (soft and hard) for the daemon, when the test sets one.
    fd_limit: Option<u64>,
    /// The daemon runs without CAP_DAC_READ_SEARCH: no file handles (`open_by_handle_at`), as
    /// a daemon that is not root runs.
    without_file_handles: bool,
    mounted: bool,
    /// The backing directory is the mount's own (not given by the test): its state directory
    /// goes when the mount does. A test that gives one keeps a `StateCleanup` of its own.
    owns_backing: bool,
    /// Mounted from `sqlite:` this database file (in the backing directory) instead.
    pub database: Option<PathBuf>,
    /// Mounted from a prefix of an S3 bucket instead (`s3://BUCKET/PREFIX`).
    s3: Option<S3Source>,
}

/// What a mount of a prefix of a bucket on a test's S3 server needs beside its options.
struct S3Source {
    source: String,
    /// `endpoint=...,region=...,state=...`: the server, and a state directory in the mount's own
    /// temporary directory.
    options: String,
    /// The server's keys: the daemon takes them from its environment only.
    env: Vec<(String, String)>,
}

/// Removes the default state directory of a backing directory (its intent log, 64 MiB) and
/// its runtime directory when dropped: a test's backing directory is gone after it, and
/// nothing else would ever remove them (CI machines gathered gigabytes in /var/lib).
pub struct StateCleanup {
    state: PathBuf,
    runtime: PathBuf,
}

impl StateCleanup {
    pub fn of(backing: &Path) -> StateCleanup {
        StateCleanup { state: state_dir(backing), runtime: runtime_dir(backing) }
    }
}

impl Drop for StateCleanup {
    fn drop(&mut self) {
        remove_state_dir(&self.state);
        remove_runtime_dir(&self.runtime);
    }
}

/// linux/fs.h: the inode flags, and the immutable one.
pub const FS_IOC_GETFLAGS: libc::c_ulong = 0x8008_6601;
pub const FS_IMMUTABLE_FL: libc::c_int = 0x10;

/// The inode flags of `path` (FS_IOC_GETFLAGS).
pub fn inode_flags(path: &Path) -> libc::c_int {
    let file = std::fs::File::open(path).unwrap();
    let mut flags: libc::c_int = 0;
    // SAFETY: the ioctl reads or writes one value of the type its request is defined with, a live
    // value borrowed for the call.
    assert_eq!(unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&file), FS_IOC_GETFLAGS, &mut flags) }, 0);
    flags
}

/// Removes a state directory. The log file of a daemon that was killed while it wrote the
/// file's blocks on the device is still immutable (the next mount or `coalescefs forget`
/// clears it): cleared here first, as `forget` does.
pub fn remove_state_dir(state: &Path) {
    let _ = coalescefs::engine::intent_log::raw::clear_immutable(&state.join(coalescefs::state::LOG_FILE_NAME));
    let _ = std::fs::remove_dir_all(state);
}

/// The daemon's log stays for a failing test's message to point at; otherwise it goes, and
/// with it the directory under /dev/shm that may hold the log's volatile tail
/// (src/runtime.rs `volatile_tail_path`, where /run is not tmpfs; a killed daemon leaves it).
pub fn remove_runtime_dir(runtime: &Path) {
    if !std::thread::panicking() {
        let _ = std::fs::remove_dir_all(runtime);
        if let Some(name) = runtime.file_name() {
            let _ = std::fs::remove_dir_all(coalescefs::runtime::shm_base_dir().join(name));
        }
    }
}

impl TestMount {
    pub fn new() -> TestMount {
        Self::with_options(&["allow_other"])
    }

    pub fn with_options(options: &[&str]) -> TestMount {
        Self::build(options, &[], None)
    }

    /// A mount with extra environment for the daemon, over `backing` if given (it must exist).
    pub fn build(options: &[&str], env: &[(&str, &str)], backing: Option<&Path>) -> TestMount {
        Self::build_limited(options, env, backing, None, false)
    }

    /// A mount whose daemon may open at most `fd_limit` descriptors (soft and hard limit).
    pub fn with_descriptor_limit(options: &[&str], fd_limit: u64) -> TestMount {
        Self::build_limited(options, &[], None, Some(fd_limit), false)
    }

    fn build_limited(
        options: &[&str],
        env: &[(&str, &str)],
        backing: Option<&Path>,
        fd_limit: Option<u64>,
        without_file_handles: bool,
    ) -> TestMount {
        let dir = tempfile::Builder::new().prefix("coalescefs-test-").tempdir().expect("tempdir");
        let owns_backing = backing.is_none();
        let backing = backing.map(Path::to_path_buf).unwrap_or_else(|| dir.path().join("backing"));
        let mnt = dir.path().join("mnt");
        if !backing.exists() {
            std::fs::create_dir(&backing).unwrap();
        }
        std::fs::create_dir(&mnt).unwrap();
        // World-searchable so that tests acting as another user can reach the mount.
        for p in [dir.path(), backing.as_path(), mnt.as_path()] {
            set_mode(p, 0o755);
        }
        let mut m = TestMount {
            _dir: dir,
            backing,
            mnt,
            options: options.iter().map(std::string::ToString::to_string).collect(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            fd_limit,
            without_file_handles,
            mounted: false,
            owns_backing,
            database: None,
            s3: None,
        };
        m.mount();
        m
    }

    /// A mount of a SQLite database (`sqlite:PATH`), made in the mount's own directory.
    pub fn over_sqlite(options: &[&str]) -> TestMount {
        Self::in_own_directory(options, |dir| (Some(dir.join("backing").join("tree.db")), None))
    }

    /// A mount of a prefix of its own (the name of its temporary directory) in `bucket` on
    /// `server` (which makes the bucket if missing), its state directory in that temporary
    /// directory.
    pub fn over_s3(server: &s3::S3Server, bucket: &str, options: &[&str]) -> TestMount {
        server.client(bucket, std::time::Duration::from_secs(30));
        Self::in_own_directory(options, |dir| {
            let prefix = dir.file_name().unwrap().to_str().unwrap();
            let s3 = S3Source {
                source: format!("s3://{bucket}/{prefix}"),
                options: format!(
                    "endpoint={},region={},state={}",
                    server.endpoint,
                    server.region,
                    path_str(&dir.join("state"))
                ),
                env: vec![
                    ("AWS_ACCESS_KEY_ID".into(), server.access_key.clone()),
                    ("AWS_SECRET_ACCESS_KEY".into(), server.secret_key.clone()),
                ],
            };
            (None, Some(s3))
        })
    }

    /// A mount made in a temporary directory of its own (`backing` and `mnt` in it), of the
    /// store `store` names for that directory: a database file or an S3 prefix (neither: the
    /// backing directory).
    fn in_own_directory(
        options: &[&str],
        store: impl FnOnce(&Path) -> (Option<PathBuf>, Option<S3Source>),
    ) -> TestMount {
        let dir = tempfile::Builder::new().prefix("coalescefs-test-").tempdir().expect("tempdir");
        let backing = dir.path().join("backing");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&backing).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        let (database, s3) = store(dir.path());
        let mut m = TestMount {
            database,
            s3,
            _dir: dir,
            backing,
            mnt,
            options: options.iter().map(std::string::ToString::to_string).collect(),
            env: Vec::new(),
            fd_limit: None,
            without_file_handles: false,
            mounted: false,
            owns_backing: true,
        };
        m.mount();
        m
    }

    /// The state directory of an S3 mount goes, as a machine's would be lost: its next mount
    /// builds the tree from the bucket alone.
    pub fn lose_state_directory(&mut self) {
        assert!(!self.mounted && self.s3.is_some());
        remove_state_dir(&self.state_dir());
    }

    /// What the runtime and state directories are keyed by: the backing directory, the
    /// database file, or the `s3://` source.
    fn source_path(&self) -> &Path {
        match &self.s3 {
            Some(s3) => Path::new(&s3.source),
            None => self.database.as_deref().unwrap_or(&self.backing),
        }
    }

    /// `build`, with a daemon that cannot use file handles (see `without_file_handles`); None
    /// where this process cannot drop the capability (not root).
    pub fn without_file_handles(options: &[&str], env: &[(&str, &str)]) -> Option<TestMount> {
        // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        Some(Self::build_limited(options, env, None, None, true))
    }

    pub fn mount(&mut self) {
        assert!(!self.mounted);
        let source = match (&self.s3, &self.database) {
            (Some(s3), _) => s3.source.clone(),
            (None, Some(db)) => format!("sqlite:{}", path_str(db)),
            (None, None) => path_str(&self.backing),
        };
        let mut args = vec!["mount".to_string(), source, path_str(&self.mnt)];
        let mut options = self.options.clone();
        if let Some(s3) = &self.s3 {
            options.push(s3.options.clone());
        }
        if !options.is_empty() {
            args.push("-o".into());
            args.push(options.join(","));
        }
        let mut command = Command::new(BIN);
        command.args(&args).envs(self.env.iter().cloned());
        if let Some(s3) = &self.s3 {
            command.envs(s3.env.iter().cloned());
        }
        if let Some(limit) = self.fd_limit {
            use std::os::unix::process::CommandExt;
            let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            // Between fork and exec only async-signal-safe calls: setrlimit is one.
            // SAFETY: the closure runs between fork and exec, where only async-signal-safe calls
            // are allowed: setrlimit is one, and it reads `rlimit`, a copy moved into the closure.
            unsafe {
                command.pre_exec(move || match libc::setrlimit(libc::RLIMIT_NOFILE, &raw const rlimit) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                });
            }
        }
        if self.without_file_handles {
            use std::os::unix::process::CommandExt;
            // Out of the bounding set, root's exec does not give it back.
            const CAP_DAC_READ_SEARCH: libc::c_ulong = 2; // linux/capability.h
                                                          // SAFETY: the closure runs between fork and exec, where only async-signal-safe calls
                                                          // are allowed: prctl is one, and it takes only integers.
            unsafe {
                command.pre_exec(|| match libc::prctl(libc::PR_CAPBSET_DROP, CAP_DAC_READ_SEARCH, 0, 0, 0) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                });
            }
        }
        let out = command.output().expect("run coalescefs mount");
        assert!(out.status.success(), "mount failed: {}", stderr_of(&out));
        self.mounted = true;
    }

    pub fn unmount(&mut self) {
        if self.mounted {
            let out =
                retried_while_busy(std::time::Duration::from_secs(5), || coalescefs(&["umount", &path_str(&self.mnt)]));
            assert!(out.status.success(), "umount failed: {}", stderr_of(&out));
            self.mounted = false;
        }
    }

    /// The test unmounted (or killed) it by other means: drop leaves the mount alone and only
    /// removes the temporary directories.
    pub fn assume_unmounted(&mut self) {
        self.mounted = false;
    }

    /// The options of the next `mount`.
    pub fn set_options(&mut self, options: &[&str]) {
        self.options = options.iter().map(std::string::ToString::to_string).collect();
    }

    pub fn remount(&mut self) {
        self.unmount();
        self.mount();
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// `coalescefs sync`: everything written so far on the backend and synced (with the intent
    /// log, the default, a checkpoint: new files the log held are made on the backend).
    pub fn sync_to_backend(&self) {
        let out = coalescefs(&["sync", &path_str(&self.mnt)]);
        assert!(out.status.success(), "coalescefs sync: {}", stderr_of(&out));
    }

    pub fn backing_path(&self, rel: &str) -> PathBuf {
        self.backing.join(rel)
    }

    /// The daemon's runtime directory (log, pid, control socket; see src/runtime.rs).
    pub fn runtime_dir(&self) -> PathBuf {
        runtime_dir(self.source_path())
    }

    /// The daemon's state directory (the intent log's file; see src/state.rs), by default.
    pub fn state_dir(&self) -> PathBuf {
        match &self.s3 {
            Some(_) => self._dir.path().join("state"),
            None => state_dir(self.source_path()),
        }
    }

    /// The intent log's file with `log=on`.
    pub fn log_path(&self) -> PathBuf {
        self.state_dir().join("intent.log")
    }

    /// What the daemon has logged so far.
    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.runtime_dir().join("daemon.log")).unwrap_or_default()
    }

    /// `coalescefs stats`, as name -> value.
    pub fn stats(&self) -> std::collections::HashMap<String, u64> {
        let out = coalescefs(&["stats", &path_str(&self.mnt)]);
        assert!(out.status.success(), "stats failed: {}", stderr_of(&out));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                Some((words.next()?.to_string(), words.next()?.parse().ok()?))
            })
            .collect()
    }

    /// One counter, asked of the daemon's control socket from this process: unlike `stats`, no
    /// child process inherits the test's open files (and closes them at exec, which the
    /// file system sees as a close).
    pub fn counter(&self, name: &str) -> u64 {
        use std::io::{Read, Write};
        let socket = self.runtime_dir().join("control.sock");
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("control socket");
        stream.write_all(b"stats\n").unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        answer
            .lines()
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next()? == name).then(|| words.next()?.parse().ok())?
            })
            .unwrap_or_else(|| panic!("no counter {name} in:\n{answer}"))
    }

    /// A request to the daemon's control socket, answered with its reply.
    pub fn control(&self, request: &str) -> String {
        control_in(&self.runtime_dir(), request)
    }

    /// Adds a fault rule (see src/backend/faults.rs); the mount must run with COALESCEFS_FAULTS.
    pub fn inject(&self, rule: &str) {
        let answer = self.control(&format!("inject {rule}"));
        assert_eq!(answer.trim(), "ok", "inject {rule}");
    }

    pub fn clear_faults(&self) {
        assert_eq!(self.control("clear").trim(), "ok");
    }

    /// `coalescefs umount`, its output returned whatever its status: the test judges it.
    pub fn unmount_reporting(&mut self) -> Output {
        assert!(self.mounted);
        let out = coalescefs(&["umount", &path_str(&self.mnt)]);
        self.mounted = false;
        out
    }

    /// Aborts the mount's FUSE connection (fusectl): every request waiting on it fails, and
    /// processes stuck on it can die. For a test that found the mount frozen.
    pub fn abort_connection(&self) {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mnt = path_str(&self.mnt);
        let Some(minor) = info.lines().find_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            (fields.get(4) == Some(&mnt.as_str())).then(|| fields[2].split_once(':').unwrap().1.to_string())
        }) else {
            return;
        };
        let _ =
            std::process::Command::new("mount").args(["-t", "fusectl", "none", "/sys/fs/fuse/connections"]).output();
        let _ = std::fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1\n");
    }

    /// For a test that measures gaps of a few milliseconds (the bursts of closes `log_closes=auto`
    /// tells by 2 ms): the calling thread and every thread of the daemon get nice -15, so that
    /// the other tests running beside it on a small machine do not stretch its gaps. Only as
    /// root (a lower nice value needs CAP_SYS_NICE); elsewhere nothing changes.
    pub fn run_ahead_of_other_tests(&self) {
        // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        // SAFETY: `setpriority` takes only integers and touches none of our memory.
        let nice = |tid: i32| unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, -15) };
        assert_eq!(nice(0), 0, "{}", std::io::Error::last_os_error());
        // Per thread: a process's threads each have their own nice value.
        for task in std::fs::read_dir(format!("/proc/{}/task", self.daemon_pid())).unwrap() {
            let tid: i32 = task.unwrap().file_name().to_string_lossy().parse().unwrap();
            let _ = nice(tid); // a thread that ended meanwhile
        }
    }

    pub fn daemon_pid(&self) -> i32 {
        std::fs::read_to_string(self.runtime_dir().join("pid"))
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }
}

impl Drop for TestMount {
    fn drop(&mut self) {
        if self.mounted {
            let out = coalescefs(&["umount", &path_str(&self.mnt)]);
            if !out.status.success() {
                let _ = coalescefs(&["umount", "--lazy", &path_str(&self.mnt)]);
            }
        }
        // The state and runtime directories live outside the temporary directory; they go
        // with the test.
        if self.owns_backing {
            remove_state_dir(&self.state_dir());
            remove_runtime_dir(&self.runtime_dir());
        }
    }
}

/// The runtime directory of the mount of `backing`, as src/runtime.rs names it: under
/// /run/coalescefs (root), the canonical backing path escaped as `systemd-escape --path` does.
pub fn runtime_dir(backing: &Path) -> PathBuf {
    PathBuf::from("/run/coalescefs").join(escaped_name(backing))
}

/// The default state directory of `backing` (src/state.rs): /var/lib/coalescefs/<escaped>.
pub fn state_dir(backing: &Path) -> PathBuf {
    PathBuf::from("/var/lib/coalescefs").join(escaped_name(backing))
}

fn escaped_name(backing: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let canonical = std::fs::canonicalize(backing).unwrap_or_else(|_| backing.to_path_buf());
    let bytes = canonical.as_os_str().as_bytes();
    let trimmed: Vec<u8> = bytes.iter().copied().skip_while(|&b| b == b'/').collect();
    let trimmed = &trimmed[..trimmed.iter().rposition(|&b| b != b'/').map_or(0, |i| i + 1)];
    let mut name = String::new();
    for (i, &b) in trimmed.iter().enumerate() {
        match b {
            b'/' => name.push('-'),
            b'.' if i > 0 => name.push('.'),
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b':' | b'_' => name.push(b as char),
            other => name.push_str(&format!("\\x{other:02x}")),
        }
    }
    // SAFETY: `geteuid` takes no arguments, cannot fail and touches none of our memory.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the runtime and state directories of a non-root daemon are elsewhere");
    if name.is_empty() {
        "-".to_string()
    } else {
        name
    }
}

pub fn path_str(p: &Path) -> String {
    p.to_str().expect("utf-8 test path").to_string()
}

pub fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub fn cstr(p: &Path) -> std::ffi::CString {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// The value of extended attribute `name` of `path` itself (not followed), or its errno.
pub fn xattr_of(path: &Path, name: &str) -> Result<Vec<u8>, i32> {
    let name = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 4096];
    // SAFETY: `lgetxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::lgetxattr(cstr(path).as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(errno());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// The names of `path`'s extended attributes.
pub fn xattr_names(path: &Path) -> Vec<String> {
    let mut buf = vec![0u8; 65536];
    // SAFETY: `llistxattr`: the C strings are NUL-terminated and outlive the call; the buffer is a
    // live, exclusively borrowed slice passed with its own length, so the kernel writes within it.
    let n = unsafe { libc::llistxattr(cstr(path).as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "listxattr {}: errno {}", path.display(), errno());
    buf[..n as usize].split(|&b| b == 0).filter(|n| !n.is_empty()).map(|n| String::from_utf8_lossy(n).into()).collect()
}

pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

/// Runs a command as another user (setpriv from util-linux), for ownership and permission tests.
pub fn run_as(uid: u32, gid: u32, program: &str, args: &[&str]) -> Output {
    Command::new("setpriv")
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"))
        .arg("--clear-groups")
        .arg(program)
        .args(args)
        .output()
        .expect("run setpriv")
}

/// Kills the process `pid` with SIGKILL (as a crash would end a daemon) and waits until it has
/// finished, at most 20 s.
/// Kills the daemon whose runtime directory is `runtime` (kill -9, until it is gone) and clears
/// its dead mount at `mnt` lazily, as a crash leaves it for the next mount.
pub fn kill_daemon_of(runtime: &Path, mnt: &Path) {
    let pid: i32 = std::fs::read_to_string(runtime.join("pid")).unwrap().trim().parse().unwrap();
    kill_and_wait(pid);
    let out = coalescefs(&["umount", "--lazy", &path_str(mnt)]);
    assert!(out.status.success(), "{}", stderr_of(&out));
}

/// A request to the control socket of the daemon whose runtime directory is `runtime`,
/// answered with its reply.
pub fn control_in(runtime: &Path, request: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(runtime.join("control.sock")).expect("control socket");
    stream.write_all(format!("{request}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

/// The daemon's log in its runtime directory (empty when there is none).
pub fn daemon_log_in(runtime: &Path) -> String {
    std::fs::read_to_string(runtime.join("daemon.log")).unwrap_or_default()
}

/// An unmount (`run`) tried again while it answers that the target is busy, for at most
/// `within`; its last output. Tests run side by side in one process: a child another test forks
/// holds a copy of every descriptor (this test's files too) until it execs, and umount(2) answers
/// EBUSY meanwhile (CI's loaded machine saw it).
pub fn retried_while_busy(within: std::time::Duration, mut run: impl FnMut() -> Output) -> Output {
    let deadline = std::time::Instant::now() + within;
    loop {
        let out = run();
        if out.status.success() || !stderr_of(&out).contains("is busy") || std::time::Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Unmounts `mnt` for a test's Drop: cleanly, else lazily (a file a failed test left open).
pub fn unmount_in_drop(mnt: &Path) {
    if !coalescefs(&["umount", &path_str(mnt)]).status.success() {
        let _ = coalescefs(&["umount", "--lazy", &path_str(mnt)]);
    }
}

pub fn kill_and_wait(pid: i32) {
    // SAFETY: kill takes no pointers; `pid` is the caller's daemon, alive until this ends it.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !process_gone(pid) {
        assert!(std::time::Instant::now() < deadline, "the daemon did not die");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether a process has finished: gone, or a zombie its parent has not reaped yet.
pub fn process_gone(pid: i32) -> bool {
    // A zombie leader is not enough: its other threads may still be finishing a system call,
    // and the process's files (the backing directory's lock) stay open until the last one ends.
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    tasks.flatten().all(|task| match std::fs::read_to_string(task.path().join("stat")) {
        Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
        Err(_) => true,
    })
}

/// A real, small ext4 on a loop device: a backend that genuinely runs out of space.
pub struct SmallFileSystem {
    pub dir: tempfile::TempDir,
}

impl SmallFileSystem {
    pub fn new(mib: u64) -> SmallFileSystem {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("fs.img");
        let f = std::fs::File::create(&image).unwrap();
        f.set_len(mib << 20).unwrap();
        let ok = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(&image)
            .status()
            .unwrap()
            .success();
        assert!(ok);
        std::fs::create_dir(dir.path().join("fs")).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(dir.path().join("fs"))
            .status()
            .unwrap()
            .success();
        assert!(ok, "loop mount");
        SmallFileSystem { dir }
    }
    pub fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("fs")
    }
}

impl Drop for SmallFileSystem {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.path()).status();
    }
}

/// A loop device over a sparse file of `mib` MiB (zeros), detached when dropped; None where
/// this process cannot make one (not root, no loop devices): the caller skips.
pub struct LoopDevice {
    pub path: String,
    _dir: tempfile::TempDir,
}

impl LoopDevice {
    pub fn new(mib: u64) -> Option<LoopDevice> {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("device.img");
        std::fs::File::create(&image).unwrap().set_len(mib << 20).unwrap();
        let out = std::process::Command::new("losetup")
            .args(["--find", "--show", "--direct-io=on"])
            .arg(&image)
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!("skipped: no loop device ({})", String::from_utf8_lossy(&out.stderr).trim());
            return None;
        }
        Some(LoopDevice { path: String::from_utf8(out.stdout).unwrap().trim().to_string(), _dir: dir })
    }

    /// Bytes written to the device so far (/proc/diskstats, 512-byte sectors).
    pub fn written_bytes(&self) -> u64 {
        let name = self.path.trim_start_matches("/dev/");
        let stats = std::fs::read_to_string("/proc/diskstats").unwrap();
        let line = stats.lines().find(|l| l.split_whitespace().nth(2) == Some(name)).expect("the device's line");
        line.split_whitespace().nth(9).unwrap().parse::<u64>().unwrap() * 512
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").args(["-d", &self.path]).status();
    }
}

/// Drops the kernel's caches, so that the next stat asks the daemon instead of the kernel's
/// cached attributes. None where this process may not (not root): the caller skips.
pub fn drop_kernel_caches() -> Option<()> {
    // SAFETY: `sync` takes no arguments, cannot fail and touches none of our memory.
    unsafe { libc::sync() };
    let _dropping = KERNEL_CACHES.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").ok()
}

/// The tests of one test binary run side by side: one that counts what reaches the daemon while
/// the kernel's caches answer holds this, so that another's `drop_kernel_caches` waits (CI saw a
/// cached missing name looked up again, dropped in between).
pub static KERNEL_CACHES: std::sync::RwLock<()> = std::sync::RwLock::new(());
