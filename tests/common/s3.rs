//! A real S3 server (SeaweedFS) for tests, started and stopped through `scripts/s3-server` as
//! CI and a developer would, with its data in a temporary directory; stopped on drop.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use coalescefs::backend::s3::client::{S3Client, S3Config, S3Credentials};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/s3-server");

pub struct S3Server {
    dir: tempfile::TempDir,
    pub endpoint: String,
    pub region: String,
    pub access_key: String,
    pub secret_key: String,
    /// The pid of `weed` itself.
    pub pid: i32,
}

impl S3Server {
    /// A server of its own for one test, or why none could start (the caller skips with it).
    pub fn start() -> Result<S3Server, String> {
        let dir = tempfile::Builder::new().prefix("s3-server.").tempdir().map_err(|e| e.to_string())?;
        let env = run_start(dir.path())?;
        let get =
            |name: &str| env.get(name).cloned().ok_or_else(|| format!("scripts/s3-server start printed no {name}"));
        Ok(S3Server {
            endpoint: get("S3_ENDPOINT")?,
            region: get("S3_REGION")?,
            access_key: get("AWS_ACCESS_KEY_ID")?,
            secret_key: get("AWS_SECRET_ACCESS_KEY")?,
            pid: get("S3_PID")?.parse().map_err(|e| format!("S3_PID: {e}"))?,
            dir,
        })
    }

    /// Starts the server again on the same directory and port (after `stop` or a kill).
    pub fn start_again(&mut self) {
        let env = run_start(self.dir.path()).unwrap();
        assert_eq!(env["S3_ENDPOINT"], self.endpoint, "the server came back on another port");
        self.pid = env["S3_PID"].parse().unwrap();
    }

    pub fn stop(&self) {
        let out = Command::new(SCRIPT).arg("stop").arg(self.dir.path()).output().unwrap();
        assert!(out.status.success(), "scripts/s3-server stop: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill(2) takes plain integers; the pid is weed's, started for this test.
        assert_eq!(unsafe { libc::kill(self.pid, signal) }, 0);
    }

    /// Kills weed with SIGKILL and waits until it is gone (a zombie counts as gone: its parent,
    /// the script's shell, has exited and someone else reaps it).
    pub fn kill(&self) {
        self.signal(libc::SIGKILL);
        let stat = PathBuf::from(format!("/proc/{}/stat", self.pid));
        super::wait_for(
            || {
                std::fs::read_to_string(&stat)
                    .map_or(true, |s| s.rsplit(") ").next().is_some_and(|r| r.starts_with('Z')))
            },
            "weed to die",
        );
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn config(&self, bucket: &str, io_timeout: Duration) -> S3Config {
        S3Config { endpoint: self.endpoint.clone(), region: self.region.clone(), bucket: bucket.to_owned(), io_timeout }
    }

    pub fn credentials(&self) -> S3Credentials {
        S3Credentials::new(&self.access_key, &self.secret_key, None)
    }

    /// A client of `bucket`, which it makes if missing.
    pub fn client(&self, bucket: &str, io_timeout: Duration) -> S3Client {
        let client = S3Client::with_credentials(&self.config(bucket, io_timeout), self.credentials()).unwrap();
        client.create_bucket().unwrap();
        client
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = Command::new(SCRIPT).arg("stop").arg(self.dir.path()).output();
    }
}

fn run_start(dir: &Path) -> Result<HashMap<String, String>, String> {
    let out = Command::new(SCRIPT).arg("start").arg(dir).output().map_err(|e| format!("{SCRIPT}: {e}"))?;
    if !out.status.success() {
        return Err(format!("scripts/s3-server start failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// A server for `test`, or None after `common::skip` said why (which fails under CI).
pub fn server_or_skip(test: &str) -> Option<S3Server> {
    match S3Server::start() {
        Ok(server) => Some(server),
        Err(why) => {
            super::skip(test, &why);
            None
        }
    }
}
