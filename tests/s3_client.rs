//! The S3 client (`src/backend/s3/client.rs`) against a real SeaweedFS that
//! `scripts/s3-server` starts on 127.0.0.1: objects put, read whole and by range, listed across
//! pages and deleted; one winner among racing conditional puts; the mount-time probe; a stopped
//! server failing calls within `io_timeout` (no hang), a killed one failing fast, both served
//! again once the server is back on the same port; wrong keys refused without the secret shown.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use coalescefs::backend::s3::client::{S3Client, S3Credentials};
use coalescefs::backend::s3::objects::{Listed, ObjectError, ObjectStore, PutCondition, PutOutcome};
use common::s3::server_or_skip;

const IO_TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn objects_round_trip_with_ranges_listing_pages_and_deletes() {
    let Some(server) = server_or_skip("objects_round_trip_with_ranges_listing_pages_and_deletes") else { return };
    let store = server.client("round-trip", IO_TIMEOUT).with_list_page_keys(3);

    let body: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(store.put("p/unit", &body, PutCondition::Always).unwrap(), PutOutcome::Written);
    assert_eq!(store.get("p/unit", None).unwrap().unwrap(), body);
    assert_eq!(store.head("p/unit").unwrap(), Some(100_000));
    assert_eq!(store.get("p/unit", Some(10..20)).unwrap().unwrap(), &body[10..20]);
    // Clipped at the end; past the end and empty ranges are empty, not errors.
    assert_eq!(store.get("p/unit", Some(99_990..200_000)).unwrap().unwrap(), &body[99_990..]);
    assert_eq!(store.get("p/unit", Some(100_000..100_010)).unwrap().unwrap(), b"");
    assert_eq!(store.get("p/unit", Some(5..5)).unwrap().unwrap(), b"");
    // An overwrite replaces, a missing key is None everywhere.
    store.put("p/unit", b"short", PutCondition::Always).unwrap();
    assert_eq!(store.get("p/unit", None).unwrap().unwrap(), b"short");
    assert_eq!(store.get("p/none", None).unwrap(), None);
    assert_eq!(store.get("p/none", Some(0..4)).unwrap(), None);
    assert_eq!(store.head("p/none").unwrap(), None);
    // An empty object: there, with no bytes in any range.
    store.put("p/empty", b"", PutCondition::Always).unwrap();
    assert_eq!(store.head("p/empty").unwrap(), Some(0));
    assert_eq!(store.get("p/empty", None).unwrap().unwrap(), b"");
    assert_eq!(store.get("p/empty", Some(0..10)).unwrap().unwrap(), b"");

    // 10 keys under the prefix, in pages of 3 (4 pages, 3 continuation tokens), and keys
    // outside the prefix not listed; names that need escaping in URLs and listings.
    let mut expected = vec![Listed { key: "p/empty".into(), size: 0 }, Listed { key: "p/unit".into(), size: 5 }];
    for i in 0..8 {
        let key = format!("p/list/{i:02} a+b%c");
        store.put(&key, &vec![b'x'; i], PutCondition::Always).unwrap();
        expected.push(Listed { key, size: i as u64 });
    }
    store.put("q/outside", b"x", PutCondition::Always).unwrap();
    expected.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(store.list("p/").unwrap(), expected);
    // The listing above took pages: the server keeps to max-keys and hands out tokens.
    let (first, token) = store.list_page("p/", None).unwrap();
    assert_eq!(first, expected[..3]);
    let (second, _) = store.list_page("p/", Some(&token.expect("no continuation token"))).unwrap();
    assert_eq!(second, expected[3..6]);
    assert_eq!(store.list("p/list/0").unwrap().len(), 8);
    assert_eq!(store.list("nothing/").unwrap(), vec![]);

    for listed in &expected {
        store.delete(&listed.key).unwrap();
    }
    // A delete of a key that is not there is no error.
    store.delete("p/unit").unwrap();
    assert_eq!(store.list("p/").unwrap(), vec![]);
    assert_eq!(store.list("").unwrap(), vec![Listed { key: "q/outside".into(), size: 1 }]);
}

/// CopyObject (`ObjectStore::copy`): the server copies an object to another key, over what is
/// there, a key that needs escaping included; a missing source is `false`, not an error. Run
/// against SeaweedFS here and against Ceph RGW by `tests/ceph/run`.
#[test]
fn a_copy_inside_the_server_copies_the_object_and_a_missing_source_is_false() {
    let Some(server) = server_or_skip("a_copy_inside_the_server_copies_the_object_and_a_missing_source_is_false")
    else {
        return;
    };
    let store = server.client("copies", IO_TIMEOUT);
    let body: Vec<u8> = (0..1_500_000u32).map(|i| (i * 13 % 251) as u8).collect();
    store.put("c/units/1/0.7", &body, PutCondition::Always).unwrap();
    store.put("c/target a+b", b"old", PutCondition::Always).unwrap();
    assert!(store.copy("c/units/1/0.7", "c/target a+b").unwrap());
    assert_eq!(store.get("c/target a+b", None).unwrap().unwrap(), body, "the copy, over what was there");
    assert!(store.copy("c/target a+b", "c/again").unwrap(), "a source whose key needs escaping");
    assert_eq!(store.get("c/again", None).unwrap().unwrap(), body);
    assert!(!store.copy("c/none", "c/from-none").unwrap(), "a missing source");
    assert_eq!(store.head("c/from-none").unwrap(), None);
    for key in ["c/units/1/0.7", "c/target a+b", "c/again"] {
        store.delete(key).unwrap();
    }
}

#[test]
fn if_absent_puts_racing_from_8_threads_have_exactly_one_winner() {
    let Some(server) = server_or_skip("if_absent_puts_racing_from_8_threads_have_exactly_one_winner") else { return };
    let store = Arc::new(server.client("race", IO_TIMEOUT));
    for round in 0..5 {
        let key = format!("manifest/{round}");
        let barrier = Arc::new(Barrier::new(8));
        let threads: Vec<_> = (0..8u8)
            .map(|writer| {
                let (store, barrier, key) = (store.clone(), barrier.clone(), key.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    (writer, store.put(&key, &[writer; 64], PutCondition::IfAbsent).unwrap())
                })
            })
            .collect();
        let outcomes: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let winners: Vec<u8> = outcomes.iter().filter(|(_, o)| *o == PutOutcome::Written).map(|(w, _)| *w).collect();
        assert_eq!(winners.len(), 1, "round {round}: {outcomes:?}");
        // The object is the winner's, and a later conditional put still loses.
        assert_eq!(store.get(&key, None).unwrap().unwrap(), [winners[0]; 64]);
        assert_eq!(store.put(&key, b"late", PutCondition::IfAbsent).unwrap(), PutOutcome::AlreadyThere);
    }
}

#[test]
fn the_conditional_put_probe_accepts_seaweedfs_and_leaves_no_probe() {
    let Some(server) = server_or_skip("the_conditional_put_probe_accepts_seaweedfs_and_leaves_no_probe") else {
        return;
    };
    let store = server.client("probe", IO_TIMEOUT);
    // A probe object left by an earlier prober that died does not fail the probe.
    store.put("coalescefs/probe", b"left over", PutCondition::Always).unwrap();
    coalescefs::backend::s3::objects::probe_conditional_put(&store, "coalescefs/probe").unwrap();
    assert_eq!(store.head("coalescefs/probe").unwrap(), None);
}

#[test]
fn stopped_server_times_out_killed_server_fails_fast_and_both_recover() {
    let Some(mut server) = server_or_skip("stopped_server_times_out_killed_server_fails_fast_and_both_recover") else {
        return;
    };
    let io_timeout = Duration::from_secs(2);
    let slack = Duration::from_millis(500);
    // A fresh server's first write waits for a volume to be made (seconds on a loaded machine):
    // done with the long timeout, before the short one is measured.
    let began = Instant::now();
    server.client("outage", IO_TIMEOUT).put("k", b"before", PutCondition::Always).unwrap();
    eprintln!("first put on a fresh server: {:?}", began.elapsed());
    let store = S3Client::with_credentials(&server.config("outage", io_timeout), server.credentials()).unwrap();
    assert_eq!(store.get("k", None).unwrap().unwrap(), b"before");

    // Stopped: connections are accepted by the kernel and never answered.
    server.freeze();
    for call in 0..2 {
        let began = Instant::now();
        let e = store.get("k", None).unwrap_err();
        let took = began.elapsed();
        eprintln!("stopped server, call {call}: {e} after {took:?}");
        assert!(matches!(e, ObjectError::Timeout { .. }), "{e:?}");
        assert!(e.to_string().contains("s3://outage/k"), "{e}");
        assert!(took >= io_timeout - Duration::from_millis(100) && took <= io_timeout + slack, "{took:?}");
    }
    server.signal(libc::SIGCONT);
    assert_eq!(store.get("k", None).unwrap().unwrap(), b"before");

    // Killed: refused connections, retried until io_timeout, then a network error.
    server.kill();
    let began = Instant::now();
    let e = store.put("k2", b"x", PutCondition::Always).unwrap_err();
    let took = began.elapsed();
    eprintln!("killed server: {e} after {took:?}");
    assert!(matches!(e, ObjectError::Network { .. }), "{e:?}");
    assert!(e.to_string().contains("s3://outage/k2"), "{e}");
    assert!(took <= io_timeout + slack, "{took:?}");
    assert_eq!(e.to_errno().0, libc::EIO);

    // Back on the same directory and port: the same client is served, the data kept.
    let began = Instant::now();
    server.start_again();
    eprintln!("restarted in {:?}", began.elapsed());
    // A restarted SeaweedFS may answer 500 for longer than this client's 2 s while its volume
    // loads (seen once under load): the same client is asked again until the server is back,
    // for at most 30 s; what is checked is that it is served then, with the data kept.
    let deadline = Instant::now() + Duration::from_secs(30);
    let kept = loop {
        match store.get("k", None) {
            Ok(found) => break found,
            Err(e) if Instant::now() < deadline => eprintln!("not back yet: {e}"),
            Err(e) => panic!("the restarted server did not serve the client within 30 s: {e}"),
        }
    };
    assert_eq!(kept.unwrap(), b"before");
    store.put("k2", b"after", PutCondition::Always).unwrap();
    assert_eq!(store.get("k2", None).unwrap().unwrap(), b"after");
}

#[test]
fn wrong_credentials_are_refused_naming_the_key_never_the_secret() {
    let Some(server) = server_or_skip("wrong_credentials_are_refused_naming_the_key_never_the_secret") else { return };
    server.client("keys", IO_TIMEOUT).put("kept", b"x", PutCondition::Always).unwrap();
    let secret = "wrong-secret-Zq81xPw";
    for credentials in
        [S3Credentials::new(&server.access_key, secret, None), S3Credentials::new("no-such-access-key", secret, None)]
    {
        let store = S3Client::with_credentials(&server.config("keys", IO_TIMEOUT), credentials).unwrap();
        let began = Instant::now();
        for e in
            [store.put("secret/target", b"x", PutCondition::Always).unwrap_err(), store.get("kept", None).unwrap_err()]
        {
            let shown = format!("{e} {e:?}");
            eprintln!("{shown}");
            assert!(matches!(e, ObjectError::Status { status: 400..=499, .. }), "{shown}");
            assert!([libc::EACCES, libc::EIO].contains(&e.to_errno().0), "{shown}");
            assert!(shown.contains("secret/target") || shown.contains("kept"), "{shown}");
            assert!(!shown.contains(secret) && !shown.contains(&server.secret_key), "{shown}");
        }
        // Refusals are final: not retried until io_timeout.
        assert!(began.elapsed() < IO_TIMEOUT / 2, "{:?}", began.elapsed());
    }
}
