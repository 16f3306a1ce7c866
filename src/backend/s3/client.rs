//! `S3Client`: the object store over a real S3 endpoint (Ceph RGW, SeaweedFS), blocking, one
//! HTTP exchange per call plus retries, path-style URLs (`http://host:port/bucket/key`) signed by
//! rusty-s3 (SigV4 in the query string) and sent by ureq.
//!
//! Owns: credentials (from the environment or the shared credentials file), the retry policy
//! (exponential backoff with jitter on 5xx, 429, 408, timeouts and connection failures; other
//! answers are final) and the deadline: every call, retries included, ends within `io_timeout`.
//! Must not: print a secret (Debug redacts; errors name the operation and the key, never the
//! signed URL), follow redirects, or decide what an object means.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusty_s3::actions::{CreateBucket, DeleteObject, GetObject, HeadBucket, HeadObject, ListObjectsV2, PutObject};
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};

use super::objects::{Listed, ObjectError, ObjectResult, ObjectStore, PutCondition, PutOutcome};

/// Where the client talks to, and how long a call may take.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// `http://host:port` (or https with the `tls` feature); the bucket goes in the path.
    pub endpoint: String,
    pub region: String,
    pub bucket: String,
    /// The longest one call takes, every retry included, before it fails.
    pub io_timeout: Duration,
}

/// An access key, its secret and an optional session token. Debug shows none of them.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Credentials {
    access_key: String,
    secret_key: String,
    session_token: Option<String>,
}

impl fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("S3Credentials { .. }")
    }
}

impl S3Credentials {
    pub fn new(access_key: &str, secret_key: &str, session_token: Option<&str>) -> S3Credentials {
        S3Credentials {
            access_key: access_key.to_owned(),
            secret_key: secret_key.to_owned(),
            session_token: session_token.map(str::to_owned),
        }
    }

    /// As the AWS tools find them: `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` (with
    /// `AWS_SESSION_TOKEN` if set), else the profile `AWS_PROFILE` (or `default`) of the shared
    /// credentials file (`AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/credentials`).
    pub fn from_environment() -> Result<S3Credentials, String> {
        Self::from_sources(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    fn from_sources(var: impl Fn(&str) -> Option<String>) -> Result<S3Credentials, String> {
        match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            (Some(access_key), Some(secret_key)) => {
                return Ok(S3Credentials { access_key, secret_key, session_token: var("AWS_SESSION_TOKEN") })
            }
            (Some(_), None) => return Err("AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not".into()),
            (None, Some(_)) => return Err("AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not".into()),
            (None, None) => {}
        }
        let file = match var("AWS_SHARED_CREDENTIALS_FILE") {
            Some(file) => PathBuf::from(file),
            None => match var("HOME") {
                Some(home) => Path::new(&home).join(".aws/credentials"),
                None => return Err("no S3 credentials: AWS_ACCESS_KEY_ID is not set and HOME is not set".into()),
            },
        };
        let profile = var("AWS_PROFILE").unwrap_or_else(|| "default".to_owned());
        let text = std::fs::read_to_string(&file).map_err(|e| {
            format!("no S3 credentials: AWS_ACCESS_KEY_ID is not set and {} cannot be read ({e})", file.display())
        })?;
        Self::from_credentials_file(&text, &profile).ok_or_else(|| {
            format!("{}: no profile [{profile}] with aws_access_key_id and aws_secret_access_key", file.display())
        })
    }

    /// The profile's keys in the INI text of a shared credentials file.
    fn from_credentials_file(text: &str, profile: &str) -> Option<S3Credentials> {
        let (mut in_profile, mut access_key, mut secret_key, mut session_token) = (false, None, None, None);
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                in_profile = section.trim() == profile;
                continue;
            }
            let Some((name, value)) = line.split_once('=') else { continue };
            if !in_profile {
                continue;
            }
            let value = Some(value.trim().to_owned());
            match name.trim() {
                "aws_access_key_id" => access_key = value,
                "aws_secret_access_key" => secret_key = value,
                "aws_session_token" => session_token = value,
                _ => {}
            }
        }
        Some(S3Credentials { access_key: access_key?, secret_key: secret_key?, session_token })
    }
}

pub struct S3Client {
    bucket: Bucket,
    credentials: Credentials,
    agent: ureq::Agent,
    endpoint: String,
    io_timeout: Duration,
    list_page_keys: usize,
}

impl fmt::Debug for S3Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Client")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket.name())
            .field("region", &self.bucket.region())
            .field("io_timeout", &self.io_timeout)
            .finish_non_exhaustive()
    }
}

/// How long a signed URL stays valid: past any `io_timeout`, short enough not to matter if one
/// leaked into a log.
const SIGNATURE_VALIDITY: Duration = Duration::from_secs(15 * 60);
/// The first pause between tries and the longest; each pause is drawn from [half, whole].
const BACKOFF_FIRST: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The shortest stall after which a try is given up for another.
const STALL_MIN: Duration = Duration::from_millis(100);
/// How much of an error answer's body is read and quoted.
const ERROR_BODY_BYTES_MAX: u64 = 64 * 1024;
const ERROR_MESSAGE_CHARS_MAX: usize = 300;

/// One answer of the server, error statuses included.
struct Answer {
    status: u16,
    content_length: Option<u64>,
    body: Vec<u8>,
}

enum Method {
    Get,
    Head,
    Put,
    Delete,
}

impl S3Client {
    /// A client with credentials from the environment (`S3Credentials::from_environment`).
    pub fn new(config: &S3Config) -> Result<S3Client, String> {
        Self::with_credentials(config, S3Credentials::from_environment()?)
    }

    pub fn with_credentials(config: &S3Config, credentials: S3Credentials) -> Result<S3Client, String> {
        let endpoint: url::Url =
            config.endpoint.parse().map_err(|e| format!("S3 endpoint {}: {e}", config.endpoint))?;
        if endpoint.scheme() == "https" && !cfg!(feature = "tls") {
            return Err(format!(
                "S3 endpoint {}: https needs coalescefs built with the `tls` feature",
                config.endpoint
            ));
        }
        if config.io_timeout.is_zero() {
            return Err("S3 io_timeout must be more than zero".into());
        }
        let bucket = Bucket::new(endpoint, UrlStyle::Path, config.bucket.clone(), config.region.clone())
            .map_err(|e| format!("S3 endpoint {} and bucket {}: {e}", config.endpoint, config.bucket))?;
        let credentials = match &credentials.session_token {
            Some(token) => Credentials::new_with_token(&credentials.access_key, &credentials.secret_key, token),
            None => Credentials::new(&credentials.access_key, &credentials.secret_key),
        };
        let agent = ureq::Agent::config_builder()
            // Error statuses are answers the retry policy reads, not errors.
            .http_status_as_error(false)
            // A redirect means a wrong endpoint or region: reported, not followed.
            .max_redirects(0)
            .max_redirects_will_error(false)
            // The engine's flushers call in parallel; each keeps its connection.
            .max_idle_connections_per_host(16)
            .build()
            .new_agent();
        Ok(S3Client {
            bucket,
            credentials,
            agent,
            endpoint: config.endpoint.clone(),
            io_timeout: config.io_timeout,
            list_page_keys: 1000,
        })
    }

    /// Keys per ListObjectsV2 page (S3's most is 1,000); tests make it small to page.
    pub fn with_list_page_keys(mut self, keys: usize) -> S3Client {
        self.list_page_keys = keys.clamp(1, 1000);
        self
    }

    pub fn bucket_name(&self) -> &str {
        self.bucket.name()
    }

    /// Whether the bucket exists (HEAD bucket: 200 yes, 404 no).
    pub fn bucket_exists(&self) -> ObjectResult<bool> {
        let what = format!("HEAD bucket {}", self.bucket.name());
        let answer = self.exchange(&what, Instant::now() + self.io_timeout, &|| {
            (Method::Head, HeadBucket::new(&self.bucket, Some(&self.credentials)).sign(SIGNATURE_VALIDITY), vec![])
        })?;
        match answer.status {
            200 => Ok(true),
            404 => Ok(false),
            _ => Err(status_error(&what, &answer)),
        }
    }

    /// Makes the bucket; one already there (and ours) is not an error. For tests and a first
    /// mount: no location constraint is sent, so the server puts it in its default region.
    pub fn create_bucket(&self) -> ObjectResult<()> {
        let what = format!("create bucket {}", self.bucket.name());
        let answer = self.exchange(&what, Instant::now() + self.io_timeout, &|| {
            (Method::Put, CreateBucket::new(&self.bucket, &self.credentials).sign(SIGNATURE_VALIDITY), vec![])
        })?;
        match answer.status {
            200 => Ok(()),
            409 if error_code(&answer.body).as_deref() == Some("BucketAlreadyOwnedByYou") => Ok(()),
            _ => Err(status_error(&what, &answer)),
        }
    }

    fn what(&self, op: &str, key: &str) -> String {
        format!("{op} s3://{}/{key}", self.bucket.name())
    }

    /// Sends the request `sign` makes (signed afresh for each try) until an answer that is not
    /// worth retrying, or until `deadline`: then the last failure, as a timeout when the last
    /// try ran out of time.
    fn exchange(
        &self,
        what: &str,
        deadline: Instant,
        sign: &dyn Fn() -> (Method, url::Url, Vec<(&'static str, String)>),
    ) -> ObjectResult<Answer> {
        self.exchange_with_body(what, deadline, None, sign).map(|(answer, _)| answer)
    }

    /// `exchange` with a body to send; also says whether an earlier try may have reached the
    /// server before it failed (a conditional put retried after such a try can find its own
    /// object).
    fn exchange_with_body(
        &self,
        what: &str,
        deadline: Instant,
        body: Option<&[u8]>,
        sign: &dyn Fn() -> (Method, url::Url, Vec<(&'static str, String)>),
    ) -> ObjectResult<(Answer, bool)> {
        let mut backoff = BACKOFF_FIRST;
        let mut tried_before = false;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(ObjectError::Timeout { what: what.to_owned() });
            }
            let (method, url, headers) = sign();
            let failure = match self.try_once(method, url.as_str(), &headers, body, remaining) {
                Ok(answer) if retryable(answer.status) => status_error(what, &answer),
                Ok(answer) => return Ok((answer, tried_before)),
                Err(TryFailure::Timeout) => ObjectError::Timeout { what: what.to_owned() },
                Err(TryFailure::Network(why)) => ObjectError::Network { what: what.to_owned(), why },
            };
            tried_before = true;
            let pause = jittered(backoff);
            backoff = (backoff * 2).min(BACKOFF_MAX);
            if Instant::now() + pause >= deadline {
                return Err(failure);
            }
            log::debug!("{failure}; trying again in {pause:?}");
            std::thread::sleep(pause);
        }
    }

    fn try_once(
        &self,
        method: Method,
        url: &str,
        headers: &[(&'static str, String)],
        body: Option<&[u8]>,
        remaining: Duration,
    ) -> Result<Answer, TryFailure> {
        // The global timeout (connecting, sending, the whole answer) keeps the call's deadline.
        // A try stalled for a third of io_timeout (no connection, no byte sent or received: a
        // stopped server, a lost answer) is given up for another, while a slow transfer that
        // still moves is not cut.
        let stall = remaining.min((self.io_timeout / 3).max(STALL_MIN));
        // (A macro: ureq's config builders differ in type with and without a body.)
        macro_rules! limits {
            ($config:expr) => {
                $config
                    .timeout_global(Some(remaining))
                    .timeout_connect(Some(stall))
                    .timeout_per_read(Some(stall))
                    .timeout_per_write(Some(stall))
            };
        }
        let result = match method {
            Method::Get | Method::Head | Method::Delete => {
                let mut request = match method {
                    Method::Get => self.agent.get(url),
                    Method::Head => self.agent.head(url),
                    _ => self.agent.delete(url),
                };
                for (name, value) in headers {
                    request = request.header(*name, value);
                }
                limits!(request.config()).build().call()
            }
            Method::Put => {
                let mut request = self.agent.put(url);
                for (name, value) in headers {
                    request = request.header(*name, value);
                }
                limits!(request.config()).build().send(body.unwrap_or(&[]))
            }
        };
        let mut response = result.map_err(TryFailure::from)?;
        let status = response.status().as_u16();
        let content_length =
            response.headers().get("content-length").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
        let limit = if (200..300).contains(&status) { u64::MAX } else { ERROR_BODY_BYTES_MAX };
        let body = response.body_mut().with_config().limit(limit).read_to_vec().map_err(TryFailure::from)?;
        Ok(Answer { status, content_length, body })
    }
}

enum TryFailure {
    Timeout,
    Network(String),
}

impl From<ureq::Error> for TryFailure {
    fn from(e: ureq::Error) -> TryFailure {
        match e {
            ureq::Error::Timeout(_) => TryFailure::Timeout,
            ureq::Error::Io(io)
                if matches!(io.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) =>
            {
                TryFailure::Timeout
            }
            ureq::Error::Io(io) => TryFailure::Network(io.to_string()),
            // Variants that could quote the URL (and so its signature) are named, not printed.
            ureq::Error::BadUri(_) => TryFailure::Network("bad URI".into()),
            ureq::Error::Http(_) => TryFailure::Network("bad HTTP request".into()),
            other => TryFailure::Network(other.to_string()),
        }
    }
}

/// A key as a URL path (`x-amz-copy-source`): unreserved bytes and `/` as they are, the rest
/// percent-encoded.
fn encode_key(key: &str) -> String {
    let mut encoded = String::with_capacity(key.len());
    for byte in key.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~/".contains(&byte) {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// Statuses a later try may not get: the server busy, failing or slow.
fn retryable(status: u16) -> bool {
    status >= 500 || status == 429 || status == 408
}

fn status_error(what: &str, answer: &Answer) -> ObjectError {
    ObjectError::Status { what: what.to_owned(), status: answer.status, body: error_summary(&answer.body) }
}

/// `Code: Message` of an S3 error document, else the start of the body, on one line.
fn error_summary(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let summary = match (xml_element(&text, "Code"), xml_element(&text, "Message")) {
        (Some(code), Some(message)) => format!("{code}: {message}"),
        (Some(code), None) => code.to_owned(),
        _ => text.split_whitespace().collect::<Vec<_>>().join(" "),
    };
    summary.chars().take(ERROR_MESSAGE_CHARS_MAX).collect()
}

fn error_code(body: &[u8]) -> Option<String> {
    xml_element(&String::from_utf8_lossy(body), "Code").map(str::to_owned)
}

fn xml_element<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let start = text.find(&format!("<{name}>"))? + name.len() + 2;
    let end = start + text[start..].find(&format!("</{name}>"))?;
    Some(text[start..end].trim())
}

/// A pause drawn from [d/2, d], so that clients failed by one event do not retry in step.
fn jittered(d: Duration) -> Duration {
    use std::cell::Cell;
    use std::hash::{BuildHasher, Hasher};
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            // RandomState is seeded from the OS per process and differs per thread here.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_nanos() as u64));
            h.finish() | 1
        });
    }
    let random = STATE.with(|s| {
        // xorshift64
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    });
    let half = d / 2;
    half + Duration::from_nanos(random % (half.as_nanos() as u64 + 1))
}

impl ObjectStore for S3Client {
    fn put(&self, key: &str, body: &[u8], condition: PutCondition) -> ObjectResult<PutOutcome> {
        let what = self.what("PUT", key);
        let deadline = Instant::now() + self.io_timeout;
        let (answer, tried_before) = self.exchange_with_body(&what, deadline, Some(body), &|| {
            let url = PutObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNATURE_VALIDITY);
            let headers = match condition {
                PutCondition::Always => vec![],
                PutCondition::IfAbsent => vec![("if-none-match", "*".to_owned())],
            };
            (Method::Put, url, headers)
        })?;
        match (answer.status, condition) {
            (200..=299, _) => Ok(PutOutcome::Written),
            (412, PutCondition::IfAbsent) if tried_before => {
                // A try that timed out may have written the object before its answer was lost:
                // then the object there is ours. A writer that could put the same bytes at the
                // same key is no rival (manifests and leases name their writer).
                let there = self.get_by(key, None, deadline)?;
                Ok(if there.as_deref() == Some(body) { PutOutcome::Written } else { PutOutcome::AlreadyThere })
            }
            (412, PutCondition::IfAbsent) => Ok(PutOutcome::AlreadyThere),
            _ => Err(status_error(&what, &answer)),
        }
    }

    fn get(&self, key: &str, range: Option<Range<u64>>) -> ObjectResult<Option<Vec<u8>>> {
        self.get_by(key, range, Instant::now() + self.io_timeout)
    }

    fn head(&self, key: &str) -> ObjectResult<Option<u64>> {
        self.head_by(key, Instant::now() + self.io_timeout)
    }

    fn delete(&self, key: &str) -> ObjectResult<()> {
        let what = self.what("DELETE", key);
        let answer = self.exchange(&what, Instant::now() + self.io_timeout, &|| {
            let url = DeleteObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNATURE_VALIDITY);
            (Method::Delete, url, vec![])
        })?;
        match answer.status {
            200..=299 | 404 => Ok(()),
            _ => Err(status_error(&what, &answer)),
        }
    }

    /// CopyObject: the server copies the bytes inside itself (RGW shares a large object's
    /// tail), none pass through this client. The source is named in `x-amz-copy-source`,
    /// signed with the request. A copy can fail after its 200 (S3 answers an error document
    /// then): that is an error too.
    fn copy(&self, source: &str, target: &str) -> ObjectResult<bool> {
        let what = format!("{} from {source}", self.what("COPY", target));
        let copy_source = format!("/{}/{}", self.bucket.name(), encode_key(source));
        let answer = self.exchange(&what, Instant::now() + self.io_timeout, &|| {
            let mut action = PutObject::new(&self.bucket, Some(&self.credentials), target);
            action.headers_mut().insert("x-amz-copy-source", copy_source.clone());
            let url = action.sign(SIGNATURE_VALIDITY);
            (Method::Put, url, vec![("x-amz-copy-source", copy_source.clone())])
        })?;
        match answer.status {
            200..=299 if error_code(&answer.body).is_none() => Ok(true),
            404 if error_code(&answer.body).as_deref() == Some("NoSuchKey") => Ok(false),
            200..=299 => Err(ObjectError::Status { what, status: 500, body: error_summary(&answer.body) }),
            _ => Err(status_error(&what, &answer)),
        }
    }

    fn list(&self, prefix: &str) -> ObjectResult<Vec<Listed>> {
        // One deadline for every page: the call as a whole ends within io_timeout.
        let deadline = Instant::now() + self.io_timeout;
        let mut listed = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let (page, next) = self.list_page_by(prefix, token.as_deref(), deadline)?;
            listed.extend(page);
            match next {
                // A server that hands back the token it was given would page forever.
                Some(next) if token.as_deref() != Some(next.as_str()) => token = Some(next),
                _ => break,
            }
        }
        Ok(listed)
    }
}

impl S3Client {
    /// One ListObjectsV2 page of at most `with_list_page_keys` keys from `continuation` (None:
    /// the first), and the token of the next page if there is one.
    pub fn list_page(&self, prefix: &str, continuation: Option<&str>) -> ObjectResult<(Vec<Listed>, Option<String>)> {
        self.list_page_by(prefix, continuation, Instant::now() + self.io_timeout)
    }

    /// `get` within the deadline of the call it is part of.
    fn get_by(&self, key: &str, range: Option<Range<u64>>, deadline: Instant) -> ObjectResult<Option<Vec<u8>>> {
        if let Some(range) = &range {
            if range.start >= range.end {
                return Ok(self.head_by(key, deadline)?.map(|_| Vec::new()));
            }
        }
        let what = match &range {
            Some(range) => format!("{} bytes {}..{}", self.what("GET", key), range.start, range.end),
            None => self.what("GET", key),
        };
        let answer = self.exchange(&what, deadline, &|| {
            let url = GetObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNATURE_VALIDITY);
            let headers = match &range {
                Some(range) => vec![("range", format!("bytes={}-{}", range.start, range.end - 1))],
                None => vec![],
            };
            (Method::Get, url, headers)
        })?;
        match answer.status {
            206 => Ok(Some(answer.body)),
            200 => Ok(Some(match range {
                // A server that ignores Range sends the whole object.
                Some(range) => {
                    let end = (range.end.min(answer.body.len() as u64)) as usize;
                    let start = (range.start as usize).min(end);
                    answer.body[start..end].to_vec()
                }
                None => answer.body,
            })),
            404 => Ok(None),
            // The range starts at or past the end (an empty object has no satisfiable range).
            416 if range.is_some() => Ok(Some(Vec::new())),
            _ => Err(status_error(&what, &answer)),
        }
    }

    fn head_by(&self, key: &str, deadline: Instant) -> ObjectResult<Option<u64>> {
        let what = self.what("HEAD", key);
        let answer = self.exchange(&what, deadline, &|| {
            let url = HeadObject::new(&self.bucket, Some(&self.credentials), key).sign(SIGNATURE_VALIDITY);
            (Method::Head, url, vec![])
        })?;
        match answer.status {
            200 => answer.content_length.map(Some).ok_or_else(|| ObjectError::Status {
                what,
                status: 200,
                body: "no Content-Length in the answer".into(),
            }),
            404 => Ok(None),
            _ => Err(status_error(&what, &answer)),
        }
    }

    fn list_page_by(
        &self,
        prefix: &str,
        continuation: Option<&str>,
        deadline: Instant,
    ) -> ObjectResult<(Vec<Listed>, Option<String>)> {
        let what = format!("list s3://{}/{prefix}*", self.bucket.name());
        let answer = self.exchange(&what, deadline, &|| {
            let mut list = ListObjectsV2::new(&self.bucket, Some(&self.credentials));
            // Keys come back as they are (XML-escaped): rusty-s3 0.10 asks for URL-encoded keys
            // but decodes them without turning '+' into a space, so "a b" came back as "a+b"
            // from SeaweedFS (and a '+' of the key could not be told from a space).
            list.query_mut().remove("encoding-type");
            list.with_prefix(prefix);
            list.with_max_keys(self.list_page_keys);
            if let Some(token) = continuation {
                list.with_continuation_token(token);
            }
            (Method::Get, list.sign(SIGNATURE_VALIDITY), vec![])
        })?;
        if answer.status != 200 {
            return Err(status_error(&what, &answer));
        }
        let page = ListObjectsV2::parse_response(&String::from_utf8_lossy(&answer.body)).map_err(|e| {
            ObjectError::Status { what: what.clone(), status: 200, body: format!("unreadable listing: {e}") }
        })?;
        let listed = page.contents.into_iter().map(|o| Listed { key: o.key, size: o.size }).collect();
        Ok((listed, page.next_continuation_token.filter(|t| !t.is_empty())))
    }
}

#[cfg(test)]
#[path = "client_tests.rs"]
mod tests;
