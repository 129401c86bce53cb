//! Unit tests for control.rs: the wire form of requests and answers, and bounded reading.

use super::protocol::parse_request;
use super::server::{NoRequest, RequestReader};
use super::*;

#[test]
fn requests_have_a_stable_wire_form() {
    let request = Request::Snapshot {
        origin: "a".into(),
        name: "b".into(),
        read_only: true,
    };
    let text = serde_json::to_string(&request).unwrap();
    assert_eq!(
        text,
        r#"{"op":"snapshot","origin":"a","name":"b","read_only":true}"#
    );
    let parsed: Request =
        serde_json::from_str(r#"{"op":"snapshot","origin":"a","name":"b"}"#).unwrap();
    assert_eq!(
        parsed,
        Request::Snapshot {
            origin: "a".into(),
            name: "b".into(),
            read_only: false
        }
    );
    assert!(serde_json::from_str::<Request>(r#"{"op":"format_disk"}"#).is_err());
}

#[test]
fn unknown_fields_are_refused_for_every_op() {
    for line in [
        r#"{"op":"list","x":1}"#,
        r#"{"op":"status","x":1}"#,
        r#"{"op":"delete_volume","name":"a","force":true}"#,
        r#"{"op":"grow_data","size_bytes":1,"x":1}"#,
        r#"{"op":"reserve_metadata_snap","x":1}"#,
        r#"{"op":"release_metadata_snap","x":1}"#,
        r#"{"op":"revert_volume","name":"a","snapshot":"b","force":true}"#,
        r#"{"op":"rename_volume","name":"a","new_name":"b","x":1}"#,
        r#"{"op":"diff","base":"a","target":"b","x":1}"#,
    ] {
        let error = parse_request(line.as_bytes()).unwrap_err();
        assert!(error.contains("unknown field"), "{line}: {error}");
    }
    assert_eq!(parse_request(br#"{"op":"list"}"#), Ok(Request::List));
    assert_eq!(
        parse_request(br#"{"op":"reserve_metadata_snap"}"#),
        Ok(Request::ReserveMetadataSnap)
    );
    assert_eq!(
        parse_request(br#"{"op":"revert_volume","name":"a","snapshot":"b"}"#),
        Ok(Request::RevertVolume {
            name: "a".into(),
            snapshot: "b".into(),
            delete_snapshot: false
        })
    );
    assert_eq!(
        parse_request(br#"{"op":"rename_volume","name":"a","new_name":"b"}"#),
        Ok(Request::RenameVolume {
            name: "a".into(),
            new_name: "b".into()
        })
    );
    assert_eq!(
        parse_request(br#"{"op":"snapshot","origin":"a","name":"b"}"#),
        Ok(Request::Snapshot {
            origin: "a".into(),
            name: "b".into(),
            read_only: false
        })
    );
}

#[test]
fn request_lines_are_bounded_in_length_and_time() {
    let (client, server) = UnixStream::pair().unwrap();
    let mut reader = RequestReader {
        stream: server,
        buffer: Vec::new(),
    };
    (&client).write_all(b"{\"op\":\"list\"}\n{\"op\"").unwrap();
    let line = reader.next_line(Duration::from_secs(5)).ok().unwrap();
    assert_eq!(line, br#"{"op":"list"}"#);
    assert!(matches!(
        reader.next_line(Duration::from_millis(50)),
        Err(NoRequest::TimedOut)
    ));
    (&client).write_all(&vec![b'x'; REQUEST_BYTES_MAX]).unwrap();
    assert!(matches!(
        reader.next_line(Duration::from_secs(5)),
        Err(NoRequest::TooLong)
    ));
    drop(client);
    let mut closed = RequestReader {
        stream: UnixStream::pair().unwrap().1,
        buffer: Vec::new(),
    };
    assert!(matches!(
        closed.next_line(Duration::from_secs(5)),
        Err(NoRequest::Closed)
    ));
}

#[test]
fn lines_are_bounded() {
    let mut input: &[u8] = b"abc\ndef";
    assert!(matches!(read_line(&mut input, 8).unwrap(), Line::Complete(l) if l == b"abc"));
    assert!(matches!(read_line(&mut input, 8).unwrap(), Line::Complete(l) if l == b"def"));
    assert!(matches!(read_line(&mut input, 8).unwrap(), Line::End));
    let mut long: &[u8] = b"0123456789\n";
    assert!(matches!(read_line(&mut long, 4).unwrap(), Line::TooLong));
}

#[test]
fn errors_round_trip() {
    let response: Response = Err(OpError::new(libc::EBUSY, "volume \"x\" is open")).into();
    let text = serde_json::to_string(&response).unwrap();
    assert_eq!(
        text,
        r#"{"thinpool_json":1,"ok":false,"error":{"kind":"refused","errno":16,"code":"EBUSY","message":"volume \"x\" is open"}}"#
    );
    let back: Response = serde_json::from_str(&text).unwrap();
    let error = back.into_result().unwrap().unwrap_err();
    assert_eq!(error.to_string(), "volume \"x\" is open (EBUSY)");
}
