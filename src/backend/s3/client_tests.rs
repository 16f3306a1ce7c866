use super::*;

#[test]
fn credentials_come_from_the_environment_first_then_the_profile_of_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("credentials");
    std::fs::write(
        &file,
        "[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = sdefault\n\n\
         # a comment\n[work]\naws_access_key_id=AKWORK\naws_secret_access_key=swork\naws_session_token=tok\n",
    )
    .unwrap();
    let file = file.to_str().unwrap().to_owned();
    let from = |vars: &[(&str, &str)]| {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        S3Credentials::from_sources(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    };
    assert_eq!(
        from(&[
            ("AWS_ACCESS_KEY_ID", "AKENV"),
            ("AWS_SECRET_ACCESS_KEY", "senv"),
            ("AWS_SHARED_CREDENTIALS_FILE", &file)
        ]),
        Ok(S3Credentials::new("AKENV", "senv", None))
    );
    assert_eq!(from(&[("AWS_SHARED_CREDENTIALS_FILE", &file)]), Ok(S3Credentials::new("AKDEFAULT", "sdefault", None)));
    assert_eq!(
        from(&[("AWS_SHARED_CREDENTIALS_FILE", &file), ("AWS_PROFILE", "work")]),
        Ok(S3Credentials::new("AKWORK", "swork", Some("tok")))
    );
    let missing = from(&[("AWS_SHARED_CREDENTIALS_FILE", &file), ("AWS_PROFILE", "none")]).unwrap_err();
    assert!(missing.contains("[none]"), "{missing}");
    assert!(from(&[("AWS_ACCESS_KEY_ID", "AKENV")]).unwrap_err().contains("AWS_SECRET_ACCESS_KEY"));
    let home = dir.path().to_str().unwrap();
    assert!(from(&[("HOME", home)]).unwrap_err().contains(".aws/credentials"));
}

#[test]
fn debug_shows_no_key_or_secret() {
    let credentials = S3Credentials::new("AKIDEXAMPLE", "wJalrXUtnFEMI", Some("token123"));
    let config = S3Config {
        endpoint: "http://127.0.0.1:9".into(),
        region: "us-east-1".into(),
        bucket: "b".into(),
        io_timeout: Duration::from_secs(1),
    };
    let client = S3Client::with_credentials(&config, credentials.clone()).unwrap();
    for shown in [format!("{credentials:?}"), format!("{client:?}")] {
        for secret in ["AKIDEXAMPLE", "wJalrXUtnFEMI", "token123"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }
}

#[test]
fn error_summaries_quote_the_code_and_message_only() {
    let body = b"<?xml version=\"1.0\"?>\n<Error><Code>NoSuchBucket</Code><Message>The bucket does not exist</Message>\
                 <Resource>/b/k</Resource></Error>";
    assert_eq!(error_summary(body), "NoSuchBucket: The bucket does not exist");
    assert_eq!(error_summary(b"plain\n text"), "plain text");
    assert_eq!(error_summary(&[b'x'; 1000]).len(), ERROR_MESSAGE_CHARS_MAX);
}

#[test]
fn backoff_pauses_stay_within_half_and_whole() {
    let d = Duration::from_millis(100);
    let pauses: Vec<_> = (0..200).map(|_| jittered(d)).collect();
    assert!(pauses.iter().all(|p| *p >= d / 2 && *p <= d));
    assert!(pauses.iter().any(|p| *p != pauses[0]), "no jitter");
}

#[test]
fn a_closed_port_fails_with_a_network_error_within_io_timeout() {
    // A port just bound and released: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = S3Config {
        endpoint: format!("http://127.0.0.1:{port}"),
        region: "us-east-1".into(),
        bucket: "b".into(),
        io_timeout: Duration::from_millis(700),
    };
    let client = S3Client::with_credentials(&config, S3Credentials::new("a", "s", None)).unwrap();
    let began = Instant::now();
    let e = client.head("some/key").unwrap_err();
    assert!(began.elapsed() < Duration::from_millis(700 + 300), "{:?}", began.elapsed());
    assert!(matches!(&e, ObjectError::Network { what, .. } if what.contains("some/key")), "{e:?}");
}

/// What the scripted server below does with one request.
enum Reply {
    Status(u16, &'static [u8]),
    /// Reads the request and answers nothing for this long, then closes.
    Stall(Duration),
}

/// A scripted HTTP server on 127.0.0.1 for the retry policy's unit tests (the S3 behaviour
/// itself is tested against a real server in tests/s3_client.rs): it answers each request
/// with the next reply and records `METHOD if-none-match body`.
fn scripted_server(replies: Vec<Reply>) -> (String, std::thread::JoinHandle<Vec<String>>) {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for reply in replies {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let (mut request_line, mut length, mut condition) = (String::new(), 0, "-".to_owned());
            reader.read_line(&mut request_line).unwrap();
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let line = line.trim_end();
                if line.is_empty() {
                    break;
                }
                let (name, value) = line.split_once(':').unwrap();
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.trim().parse().unwrap(),
                    "if-none-match" => condition = value.trim().to_owned(),
                    _ => {}
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let method = request_line.split(' ').next().unwrap().to_owned();
            seen.push(format!("{method} {condition} {}", String::from_utf8_lossy(&body)));
            let mut stream = reader.into_inner();
            match reply {
                Reply::Status(status, body) => {
                    let head = format!(
                        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        if method == "HEAD" { 0 } else { body.len() }
                    );
                    let _ = stream.write_all(head.as_bytes());
                    if method != "HEAD" {
                        let _ = stream.write_all(body);
                    }
                }
                Reply::Stall(d) => std::thread::sleep(d),
            }
        }
        seen
    });
    (endpoint, server)
}

fn client_of(endpoint: &str, io_timeout: Duration) -> S3Client {
    let config = S3Config { endpoint: endpoint.to_owned(), region: "r".into(), bucket: "b".into(), io_timeout };
    S3Client::with_credentials(&config, S3Credentials::new("a", "s", None)).unwrap()
}

#[test]
fn busy_answers_are_retried_and_refusals_are_final() {
    let (endpoint, server) = scripted_server(vec![
        Reply::Status(503, b"<Error><Code>SlowDown</Code></Error>"),
        Reply::Status(500, b""),
        Reply::Status(200, b""),
        Reply::Status(400, b"<Error><Code>InvalidArgument</Code></Error>"),
    ]);
    let client = client_of(&endpoint, Duration::from_secs(5));
    assert_eq!(client.put("k", b"data", PutCondition::Always).unwrap(), PutOutcome::Written);
    let e = client.get("k", None).unwrap_err();
    assert!(matches!(&e, ObjectError::Status { status: 400, body, .. } if body == "InvalidArgument"), "{e:?}");
    assert_eq!(server.join().unwrap(), ["PUT - data", "PUT - data", "PUT - data", "GET - "]);
}

#[test]
fn a_server_that_ignores_if_none_match_is_refused_by_the_probe() {
    // The probe's delete, two conditional puts both accepted, the closing delete.
    let (endpoint, server) = scripted_server(vec![
        Reply::Status(204, b""),
        Reply::Status(200, b""),
        Reply::Status(200, b""),
        Reply::Status(204, b""),
    ]);
    let client = client_of(&endpoint, Duration::from_secs(5));
    let e = super::super::objects::probe_conditional_put(&client, "probe").unwrap_err();
    assert!(matches!(e, super::super::objects::ProbeError::ConditionIgnored { .. }), "{e:?}");
    assert!(e.to_string().contains("If-None-Match"), "{e}");
    let seen = server.join().unwrap();
    assert_eq!(seen.iter().map(|s| &s[..5]).collect::<Vec<_>>(), ["DELET", "PUT *", "PUT *", "DELET"]);
}

#[test]
fn a_conditional_put_whose_answer_was_lost_finds_its_own_object() {
    let stall = Duration::from_millis(600);
    // The first try's answer never comes (the object was written); the retry gets 412 and
    // reads the object: its own bytes, then (second put) another writer's.
    let (endpoint, server) = scripted_server(vec![
        Reply::Stall(stall),
        Reply::Status(412, b""),
        Reply::Status(200, b"mine"),
        Reply::Stall(stall),
        Reply::Status(412, b""),
        Reply::Status(200, b"theirs"),
    ]);
    // Tries stall out after a third of io_timeout, leaving time to retry.
    let client = client_of(&endpoint, Duration::from_millis(1500));
    assert_eq!(client.put("m", b"mine", PutCondition::IfAbsent).unwrap(), PutOutcome::Written);
    assert_eq!(client.put("m", b"mine", PutCondition::IfAbsent).unwrap(), PutOutcome::AlreadyThere);
    assert_eq!(server.join().unwrap(), ["PUT * mine", "PUT * mine", "GET - ", "PUT * mine", "PUT * mine", "GET - "]);
}

#[test]
fn https_without_the_tls_feature_is_refused_by_name() {
    let config = S3Config {
        endpoint: "https://s3.example:443".into(),
        region: "r".into(),
        bucket: "b".into(),
        io_timeout: Duration::from_secs(1),
    };
    let made = S3Client::with_credentials(&config, S3Credentials::new("a", "s", None));
    if cfg!(feature = "tls") {
        assert!(made.is_ok());
    } else {
        assert!(made.unwrap_err().contains("tls"));
    }
}
