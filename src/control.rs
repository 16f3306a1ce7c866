//! How the outside asks a running daemon: a Unix socket in its runtime directory
//! (`control.sock`, readable by the daemon's user only, see `runtime`) for `coalescefs stats`,
//! `sync` and `snapshot` (and, when fault injection is on, `inject` and `clear`), and an
//! optional Prometheus endpoint (`-o metrics=ADDR:PORT`). Both serve one short answer per
//! connection, one connection at a time, with a timeout: neither can hold the daemon up. The
//! requests that wait for the backend (`sync`, `snapshot`) are answered in turn by a thread of
//! their own, so that `stats` answers while a long checkpoint runs.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::faults::Faults;
use crate::metrics::Metrics;

const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// What `coalescefs sync` asks of the daemon: everything written made durable on the backend.
pub type SyncAll = Box<dyn Fn() -> Result<(), String> + Send>;

/// What `coalescefs snapshot` asks of the daemon: a consistent copy of the store in a new file
/// at the absolute path given, after a sync; its answer says what it made.
pub type Snapshot = Box<dyn Fn(&Path) -> Result<String, String> + Send>;

/// The longest request line: a command and a path of up to PATH_MAX bytes.
const REQUEST_MAX_BYTES: u64 = 4096 + 64;

/// The requests whose answers wait for the backend, as long as it takes.
fn waits_for_the_backend(command: &str) -> bool {
    command == "sync" || command.starts_with("snapshot ")
}

/// Requests that wait for the backend, queued behind the one being answered; more are refused
/// with a message rather than held open without bound.
const BACKEND_REQUESTS_QUEUED: usize = 16;

pub fn serve_control_socket(
    path: &Path,
    metrics: Arc<Metrics>,
    sync_all: SyncAll,
    snapshot: Snapshot,
    faults: Option<Arc<Faults>>,
) -> std::io::Result<()> {
    let _ = std::fs::remove_file(path); // a dead daemon's socket; the backing lock is ours
    let listener = UnixListener::bind(path)?;
    let (to_backend, backend_requests) = std::sync::mpsc::sync_channel::<(UnixStream, String)>(BACKEND_REQUESTS_QUEUED);
    std::thread::Builder::new().name("control-sync".into()).spawn(move || {
        for (stream, command) in backend_requests {
            let _ = (&stream).write_all(answer_backend_request(&command, &sync_all, &snapshot).as_bytes());
        }
    })?;
    std::thread::Builder::new().name("control".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = answer_control(stream, &metrics, &to_backend, faults.as_deref());
        }
    })?;
    Ok(())
}

fn answer_control(
    stream: UnixStream,
    metrics: &Arc<Metrics>,
    to_backend: &std::sync::mpsc::SyncSender<(UnixStream, String)>,
    faults: Option<&Faults>,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut command = String::new();
    BufReader::new(&stream).take(REQUEST_MAX_BYTES).read_line(&mut command)?;
    // A request ends with its line: one cut off at the bound (a path longer than any the
    // kernel takes) is refused whole, never acted on in part.
    let Some(command) = command.strip_suffix('\n') else {
        let refused = format!("error: a request is one line of at most {REQUEST_MAX_BYTES} bytes\n");
        return (&stream).write_all(refused.as_bytes());
    };
    // `sync` as the quick requests are matched, trimmed; a snapshot's path as given.
    let backend_request =
        if command.trim() == "sync" { Some("sync") } else { Some(command).filter(|c| c.starts_with("snapshot ")) };
    if let Some(request) = backend_request {
        let refused = "error: too many sync and snapshot requests are waiting for the backend; ask again later\n";
        return match to_backend.try_send((stream, request.to_string())) {
            Ok(()) => Ok(()),
            Err(std::sync::mpsc::TrySendError::Full((stream, _))) => (&stream).write_all(refused.as_bytes()),
            Err(std::sync::mpsc::TrySendError::Disconnected((stream, _))) => {
                (&stream).write_all(b"error: the daemon is stopping\n")
            }
        };
    }
    let answer = match command.trim() {
        "stats" => metrics.render_text(),
        "metrics" => metrics.render_prometheus(),
        request if request == "clear" || request.starts_with("inject ") => match faults {
            Some(faults) => match faults.control(request) {
                Ok(()) => "ok\n".to_string(),
                Err(e) => format!("error: {e}\n"),
            },
            None => "error: fault injection is off (start the daemon with COALESCEFS_FAULTS)\n".to_string(),
        },
        other => format!("error: unknown request '{other}'\n"),
    };
    (&stream).write_all(answer.as_bytes())
}

/// `sync` and `snapshot PATH`: answered when the backend has done what they ask, however long
/// that takes (the client waits without a timeout, see `ask`).
fn answer_backend_request(command: &str, sync_all: &SyncAll, snapshot: &Snapshot) -> String {
    let answered = match command.strip_prefix("snapshot ") {
        // The path as given, spaces kept: the client sent it absolute, on one line.
        Some(path) if path.starts_with('/') => snapshot(Path::new(path)).map(|made| format!("ok {made}\n")),
        Some(path) => Err(format!("a snapshot's path must be absolute, not '{path}'")),
        None => sync_all().map(|()| "ok\n".to_string()),
    };
    answered.unwrap_or_else(|e| format!("error: {e}\n"))
}

/// The client side, for `coalescefs stats`, `sync` and `snapshot`.
pub fn ask(socket: &Path, command: &str) -> std::io::Result<String> {
    assert!(!command.contains('\n'), "a request is one line");
    let mut stream = UnixStream::connect(socket)?;
    // A sync takes as long as the backend needs to write everything buffered.
    stream.set_read_timeout(if waits_for_the_backend(command) { None } else { Some(IO_TIMEOUT * 5) })?;
    stream.write_all(format!("{command}\n").as_bytes())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer)
}

/// Binds before the mount is reported ready, so a busy port fails the mount with a message.
/// One fixed document per connection, whatever was asked: a few lines of HTTP rather than an
/// HTTP stack and an async runtime in the daemon for it.
/// The Prometheus endpoint's listener, bound before the mount makes anything: an address
/// taken fails the start before there is anything to undo.
pub fn bind_prometheus(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address)
}

pub fn serve_prometheus(listener: TcpListener, metrics: Arc<Metrics>) -> std::io::Result<()> {
    std::thread::Builder::new().name("metrics".into()).spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
            let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
            let mut request = [0u8; 1024];
            let _ = (&stream).read(&mut request);
            let body = metrics.render_prometheus();
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = (&stream).write_all(response.as_bytes());
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

    /// A sync waits for the backend as long as it takes; `stats` is answered meanwhile, and a
    /// second sync waits behind the first rather than beside it.
    #[test]
    fn stats_are_answered_while_a_sync_waits_for_the_backend() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("control.sock");
        let (release, released) = std::sync::mpsc::channel::<()>();
        let released = std::sync::Mutex::new(released);
        let syncs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = syncs.clone();
        let sync_all: SyncAll = Box::new(move || {
            counted.fetch_add(1, Relaxed);
            released.lock().unwrap().recv().map_err(|e| e.to_string())
        });
        let snapshot: Snapshot = Box::new(|_| Ok(String::new()));
        serve_control_socket(&socket, Arc::new(Metrics::default()), sync_all, snapshot, None).unwrap();
        let syncing: Vec<_> = (0..2)
            .map(|_| {
                let socket = socket.clone();
                std::thread::spawn(move || ask(&socket, "sync").unwrap())
            })
            .collect();
        while syncs.load(Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let stats = ask(&socket, "stats").unwrap();
        assert!(stats.contains("log_fsyncs_total"), "{stats}");
        assert_eq!(syncs.load(Relaxed), 1, "the second sync began beside the first");
        release.send(()).unwrap();
        release.send(()).unwrap();
        for sync in syncing {
            assert_eq!(sync.join().unwrap(), "ok\n");
        }
        assert_eq!(syncs.load(Relaxed), 2);
        assert!(ask(&socket, "snapshot relative").unwrap().contains("must be absolute"));
    }

    /// A request cut off at the bound is refused whole: a snapshot is never made at a path cut
    /// short.
    #[test]
    fn a_request_longer_than_the_bound_is_refused_and_not_acted_on() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("control.sock");
        let asked = Arc::new(AtomicBool::new(false));
        let seen = asked.clone();
        let snapshot: Snapshot = Box::new(move |_| {
            seen.store(true, Relaxed);
            Ok(String::new())
        });
        serve_control_socket(&socket, Arc::new(Metrics::default()), Box::new(|| Ok(())), snapshot, None).unwrap();
        let long = format!("snapshot /{}", "a".repeat(REQUEST_MAX_BYTES as usize));
        let mut stream = UnixStream::connect(&socket).unwrap();
        stream.write_all(format!("{long}\n").as_bytes()).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("error: a request is one line"), "{answer}");
        assert!(!asked.load(Relaxed), "the snapshot was asked for a path cut short");
        let answer = ask(&socket, "snapshot /x").unwrap();
        assert_eq!(answer, "ok \n");
        assert!(asked.load(Relaxed));
    }
}
