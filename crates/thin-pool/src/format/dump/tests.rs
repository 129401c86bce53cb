//! Unit tests of the dump module that need no external tool: writer output for known event
//! streams, parse → write round trips, and one test per parser error.

use super::*;

/// Parses `text` and writes it back with an [`XmlWriter`] of `flavour`.
fn xml_round_trip(text: &str, flavour: Flavour) -> Result<String, Error> {
    let mut writer = XmlWriter::with_flavour(Vec::new(), flavour);
    xml::parse(text.as_bytes(), &mut writer)?;
    Ok(String::from_utf8(writer.into_inner()).unwrap())
}

fn human(text: &str, flavour: Flavour) -> String {
    let mut writer = HumanWriter::with_flavour(Vec::new(), flavour);
    xml::parse(text.as_bytes(), &mut writer).unwrap();
    String::from_utf8(writer.into_inner()).unwrap()
}

/// Output of `thin_dump` 1.1.0 on metadata restored from a hand-written XML with shared
/// leaves, an empty device and singles (see `tests/dump_format.rs` for the live check).
const V1_WITH_SHARING: &str = r#"<superblock uuid="" time="3" transaction="9" version="2" data_block_size="128" nr_data_blocks="20000">
  <def name="1">
    <range_mapping origin_begin="0" data_begin="1000" length="201" time="0"/>
  </def>
  <def name="2">
    <range_mapping origin_begin="201" data_begin="1201" length="399" time="0"/>
    <single_mapping origin_block="700" data_block="5" time="0"/>
  </def>
  <device dev_id="0" mapped_blocks="601" transaction="0" creation_time="0" snap_time="2">
    <ref name="1"/>
    <ref name="2"/>
  </device>
  <device dev_id="2" mapped_blocks="602" transaction="2" creation_time="2" snap_time="3">
    <range_mapping origin_begin="0" data_begin="1000" length="60" time="0"/>
    <single_mapping origin_block="60" data_block="2000" time="2"/>
    <ref name="2"/>
  </device>
  <device dev_id="5" mapped_blocks="0" transaction="2" creation_time="2" snap_time="3">
  </device>
</superblock>"#;

const V0_9: &str = r#"<superblock uuid="" time="5" transaction="9" flags="3" version="1" data_block_size="256" nr_data_blocks="1000">
  <device dev_id="3" mapped_blocks="3" transaction="1" creation_time="2" snap_time="4">
    <range_mapping origin_begin="10" data_begin="20" length="2" time="3"/>
    <single_mapping origin_block="12" data_block="7" time="3"/>
  </device>
</superblock>
"#;

#[test]
fn v1_xml_round_trips_byte_for_byte() {
    assert_eq!(
        xml_round_trip(V1_WITH_SHARING, Flavour::V1).unwrap(),
        V1_WITH_SHARING
    );
}

#[test]
fn v0_9_xml_round_trips_byte_for_byte() {
    assert_eq!(xml_round_trip(V0_9, Flavour::V0_9).unwrap(), V0_9);
}

#[test]
fn v1_prints_only_the_needs_check_bit_and_no_final_newline() {
    let v1 = xml_round_trip(V0_9, Flavour::V1).unwrap();
    assert!(v1.starts_with(
        "<superblock uuid=\"\" time=\"5\" transaction=\"9\" flags=\"1\" version=\"1\" "
    ));
    assert!(v1.ends_with("</device>\n</superblock>"));
    let clear = V0_9.replace("flags=\"3\"", "flags=\"2\"");
    let v1 = xml_round_trip(&clear, Flavour::V1).unwrap();
    assert!(v1.starts_with("<superblock uuid=\"\" time=\"5\" transaction=\"9\" version=\"1\" "));
}

#[test]
fn v0_9_writer_refuses_definitions() {
    let error = xml_round_trip(V1_WITH_SHARING, Flavour::V0_9).unwrap_err();
    assert!(
        matches!(error, Error::Unsupported { what: "<def>", .. }),
        "{error:?}"
    );
}

#[test]
fn human_readable_v1_and_v0_9() {
    let v1 = human(V0_9, Flavour::V1);
    assert_eq!(
        v1,
        "begin superblock: \"\", 5, 9, 1, 1, 256, 1000\ndevice: 3\nmapped_blocks: 3\n\
         transaction: 1\ncreation time: 2\nsnap time: 4\n    (10..11) -> (20..21), 3\n    \
         (12..12) -> (7..7), 3\n\nend superblock\n"
    );
    let v0_9 = human(V0_9, Flavour::V0_9);
    assert!(v0_9.starts_with("begin superblock: \"\", 5, 9, 3, 1, 256, 1000\n"));
    assert!(v0_9.contains("\n    12 -> 7, 3\n"));
    let shared = human(V1_WITH_SHARING, Flavour::V1);
    assert!(shared.contains("\ndef: 1\n    (0..200) -> (1000..1200), 0\n\ndef: 2\n"));
    assert!(shared.contains("snap time: 2\n    ref: 1\n    ref: 2\n\ndevice: 2\n"));
}

#[test]
fn parser_accepts_declaration_comments_long_forms_and_defaults() {
    let text = "<?xml version=\"1.0\"?>\n<!-- made by hand -->\n\
        <superblock uuid=\"a&amp;b\" time=\"1\" transaction=\"2\" data_block_size=\"128\" nr_data_blocks=\"9\" metadata_snap=\"77\">\n\
        <device dev_id=\"1\" mapped_blocks=\"1\" transaction=\"0\" creation_time=\"0\" snap_time=\"0\">\
        <single_mapping origin_block=\"4\" data_block=\"5\" time=\"0\"></single_mapping></device>\
        <device dev_id=\"2\" mapped_blocks=\"0\" transaction=\"0\" creation_time=\"0\" snap_time=\"0\"/>\
        </superblock>\n";
    let mut recorder = Recorder::default();
    xml::parse(text.as_bytes(), &mut recorder).unwrap();
    assert_eq!(
        recorder.events,
        vec![
            "superblock uuid=a&b flags=0 version=2 metadata_snap=Some(77)",
            "device 1",
            "mapping 4 5 1 0",
            "device_end",
            "device 2",
            "device_end",
            "superblock_end",
        ]
    );
}

#[derive(Default)]
struct Recorder {
    events: Vec<String>,
}

impl DumpVisitor for Recorder {
    fn superblock_begin(&mut self, superblock: &SuperblockInfo) -> Result<(), Error> {
        self.events.push(format!(
            "superblock uuid={} flags={} version={} metadata_snap={:?}",
            superblock.uuid, superblock.flags, superblock.version, superblock.metadata_snap
        ));
        Ok(())
    }
    fn superblock_end(&mut self) -> Result<(), Error> {
        self.events.push("superblock_end".into());
        Ok(())
    }
    fn def_begin(&mut self, name: &str) -> Result<(), Error> {
        self.events.push(format!("def {name}"));
        Ok(())
    }
    fn def_end(&mut self) -> Result<(), Error> {
        self.events.push("def_end".into());
        Ok(())
    }
    fn device_begin(&mut self, device: &DeviceInfo) -> Result<(), Error> {
        self.events.push(format!("device {}", device.dev_id));
        Ok(())
    }
    fn device_end(&mut self) -> Result<(), Error> {
        self.events.push("device_end".into());
        Ok(())
    }
    fn mapping(&mut self, mapping: &Mapping) -> Result<(), Error> {
        self.events.push(format!(
            "mapping {} {} {} {}",
            mapping.virtual_begin, mapping.data_begin, mapping.length, mapping.time
        ));
        Ok(())
    }
    fn reference(&mut self, name: &str) -> Result<(), Error> {
        self.events.push(format!("ref {name}"));
        Ok(())
    }
}

/// Parses `text` and returns the error's line and problem.
fn parse_error(text: &str) -> (u64, ParseProblem) {
    match xml::parse(text.as_bytes(), &mut Recorder::default()) {
        Err(Error::Parse { line, problem }) => (line, problem),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

const HEAD: &str = "<superblock uuid=\"\" time=\"0\" transaction=\"0\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"100\">\n";
const DEVICE: &str = "  <device dev_id=\"0\" mapped_blocks=\"0\" transaction=\"0\" creation_time=\"0\" snap_time=\"0\">\n";

#[test]
fn unknown_tag_is_reported_with_its_line() {
    let text = format!("{HEAD}{DEVICE}    <block_mapping a=\"1\"/>\n");
    assert_eq!(
        parse_error(&text),
        (3, ParseProblem::UnknownTag("block_mapping".into()))
    );
}

#[test]
fn missing_attribute_is_reported() {
    let text = format!("{HEAD}{DEVICE}    <single_mapping origin_block=\"1\" time=\"0\"/>\n");
    assert_eq!(
        parse_error(&text),
        (
            3,
            ParseProblem::MissingAttribute {
                tag: "single_mapping",
                attribute: "data_block"
            }
        )
    );
}

#[test]
fn unknown_and_repeated_attributes_are_reported() {
    let text = HEAD.replace("uuid=\"\"", "uuid=\"\" colour=\"red\"");
    assert!(matches!(
        parse_error(&text),
        (1, ParseProblem::UnknownAttribute { attribute, .. }) if attribute == "colour"
    ));
    let text = HEAD.replace("time=\"0\"", "time=\"0\" time=\"1\"");
    assert!(matches!(
        parse_error(&text),
        (1, ParseProblem::DuplicateAttribute { attribute, .. }) if attribute == "time"
    ));
}

#[test]
fn bad_numbers_are_reported() {
    for (attribute, value) in [
        ("time", "-1"),
        ("time", "4294967296"),
        ("time", " 1"),
        ("time", "0x10"),
        ("time", ""),
        ("transaction", "18446744073709551616"),
    ] {
        let text = HEAD.replacen(
            &format!("{attribute}=\"0\""),
            &format!("{attribute}=\"{value}\""),
            1,
        );
        let (line, problem) = parse_error(&text);
        assert_eq!(line, 1);
        assert!(
            matches!(&problem, ParseProblem::BadNumber { attribute: a, value: v, .. } if *a == attribute && v == value),
            "{problem:?}"
        );
    }
}

#[test]
fn mapping_outside_a_device_is_reported() {
    let text =
        format!("{HEAD}  <single_mapping origin_block=\"1\" data_block=\"1\" time=\"0\"/>\n");
    assert!(matches!(
        parse_error(&text),
        (2, ParseProblem::Misplaced { tag, .. }) if tag == "single_mapping"
    ));
}

#[test]
fn nested_device_and_second_superblock_are_reported() {
    let text = format!("{HEAD}{DEVICE}{DEVICE}");
    assert!(
        matches!(parse_error(&text), (3, ParseProblem::Misplaced { tag, .. }) if tag == "device")
    );
    let text = format!("{HEAD}</superblock>\n{HEAD}");
    assert!(
        matches!(parse_error(&text), (3, ParseProblem::Misplaced { tag, .. }) if tag == "superblock")
    );
}

#[test]
fn reference_to_undefined_def_is_reported() {
    let text = format!("{HEAD}{DEVICE}    <ref name=\"7\"/>\n");
    assert_eq!(
        parse_error(&text),
        (3, ParseProblem::UndefinedReference("7".into()))
    );
}

#[test]
fn duplicate_def_is_reported() {
    let text = format!("{HEAD}  <def name=\"a\">\n  </def>\n  <def name=\"a\">\n");
    assert_eq!(
        parse_error(&text),
        (4, ParseProblem::DuplicateDefinition("a".into()))
    );
}

#[test]
fn zero_length_and_overflowing_ranges_are_reported() {
    let text = format!(
        "{HEAD}{DEVICE}    <range_mapping origin_begin=\"0\" data_begin=\"0\" length=\"0\" time=\"0\"/>\n"
    );
    assert_eq!(parse_error(&text), (3, ParseProblem::ZeroLength));
    let text = format!(
        "{HEAD}{DEVICE}    <range_mapping origin_begin=\"18446744073709551615\" data_begin=\"0\" length=\"2\" time=\"0\"/>\n"
    );
    assert_eq!(parse_error(&text), (3, ParseProblem::RunOverflow));
}

#[test]
fn mismatched_end_tag_is_reported() {
    let text = format!("{HEAD}{DEVICE}  </def>\n");
    assert_eq!(
        parse_error(&text),
        (
            3,
            ParseProblem::MismatchedEnd {
                expected: "device".into(),
                found: "def".into()
            }
        )
    );
}

#[test]
fn truncated_input_is_reported() {
    let text = format!("{HEAD}{DEVICE}");
    assert_eq!(
        parse_error(&text),
        (
            3,
            ParseProblem::UnexpectedEnd {
                open: "device".into()
            }
        )
    );
    assert_eq!(
        parse_error("  \n"),
        (
            2,
            ParseProblem::UnexpectedEnd {
                open: String::new()
            }
        )
    );
}

#[test]
fn malformed_markup_is_a_syntax_error() {
    for text in [
        format!("{HEAD}{DEVICE}    <single_mapping origin_block=1 data_block=\"1\" time=\"0\"/>\n"),
        format!("{HEAD}{DEVICE}    <single_mapping origin_block=\"1\"data_block=\"1\" time=\"0\"/>\n"),
        format!("{HEAD}{DEVICE}    <single_mapping origin_block=\"&bogus;\" data_block=\"1\" time=\"0\"/>\n"),
        format!("{HEAD}{DEVICE}    <!DOCTYPE x>\n"),
    ] {
        let (line, problem) = parse_error(&text);
        assert_eq!(line, 3, "{text}");
        assert!(matches!(problem, ParseProblem::Syntax(_)), "{problem:?}");
    }
}

#[test]
fn text_after_the_superblock_is_reported() {
    let text = format!("{HEAD}</superblock>\n\ntrailing");
    assert_eq!(parse_error(&text), (4, ParseProblem::UnexpectedText));
}

#[test]
fn error_messages_name_the_line_and_the_problem() {
    let error = xml::parse(
        format!("{HEAD}{DEVICE}    <ref name=\"7\"/>\n").as_bytes(),
        &mut Recorder::default(),
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "line 3: <ref name=\"7\"/> names no earlier <def>"
    );
}

#[test]
fn visitor_errors_stop_the_parse() {
    struct Refuse;
    impl DumpVisitor for Refuse {
        fn superblock_begin(&mut self, _: &SuperblockInfo) -> Result<(), Error> {
            Err(Error::Visitor("no space".into()))
        }
        fn superblock_end(&mut self) -> Result<(), Error> {
            unreachable!()
        }
        fn def_begin(&mut self, _: &str) -> Result<(), Error> {
            unreachable!()
        }
        fn def_end(&mut self) -> Result<(), Error> {
            unreachable!()
        }
        fn device_begin(&mut self, _: &DeviceInfo) -> Result<(), Error> {
            unreachable!()
        }
        fn device_end(&mut self) -> Result<(), Error> {
            unreachable!()
        }
        fn mapping(&mut self, _: &Mapping) -> Result<(), Error> {
            unreachable!()
        }
        fn reference(&mut self, _: &str) -> Result<(), Error> {
            unreachable!()
        }
    }
    let error = xml::parse(V0_9.as_bytes(), &mut Refuse).unwrap_err();
    assert!(matches!(error, Error::Visitor(_)));
}

/// Generates a dump with `mapping_count` singles on the fly, so the input never exists in
/// memory as a whole.
struct GeneratedDump {
    mapping_count: u64,
    next_mapping: u64,
    pending: Vec<u8>,
    stage: u8,
}

impl std::io::Read for GeneratedDump {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        while self.pending.is_empty() {
            match self.stage {
                0 => {
                    self.pending = format!("{HEAD}{DEVICE}").into_bytes();
                    self.stage = 1;
                }
                1 if self.next_mapping < self.mapping_count => {
                    let block = self.next_mapping * 2;
                    self.pending = format!(
                        "    <single_mapping origin_block=\"{block}\" data_block=\"{block}\" time=\"0\"/>\n"
                    )
                    .into_bytes();
                    self.next_mapping += 1;
                }
                1 => {
                    self.pending = b"  </device>\n</superblock>\n".to_vec();
                    self.stage = 2;
                }
                _ => return Ok(0),
            }
        }
        let length = buffer.len().min(self.pending.len());
        buffer[..length].copy_from_slice(&self.pending[..length]);
        self.pending.drain(..length);
        Ok(length)
    }
}

#[test]
fn parser_streams_large_dumps() {
    let mapping_count = 200_000;
    let input = std::io::BufReader::new(GeneratedDump {
        mapping_count,
        next_mapping: 0,
        pending: Vec::new(),
        stage: 0,
    });
    struct Count(u64);
    impl DumpVisitor for Count {
        fn superblock_begin(&mut self, _: &SuperblockInfo) -> Result<(), Error> {
            Ok(())
        }
        fn superblock_end(&mut self) -> Result<(), Error> {
            Ok(())
        }
        fn def_begin(&mut self, _: &str) -> Result<(), Error> {
            Ok(())
        }
        fn def_end(&mut self) -> Result<(), Error> {
            Ok(())
        }
        fn device_begin(&mut self, _: &DeviceInfo) -> Result<(), Error> {
            Ok(())
        }
        fn device_end(&mut self) -> Result<(), Error> {
            Ok(())
        }
        fn mapping(&mut self, mapping: &Mapping) -> Result<(), Error> {
            self.0 += mapping.length;
            Ok(())
        }
        fn reference(&mut self, _: &str) -> Result<(), Error> {
            Ok(())
        }
    }
    let mut count = Count(0);
    xml::parse(input, &mut count).unwrap();
    assert_eq!(count.0, mapping_count);
}

#[test]
fn both_writers_assert_the_event_grammar() {
    // A mapping before any device, a reference inside a def, an end without a begin.
    type Misuse = fn(&mut dyn DumpVisitor) -> Result<(), Error>;
    let misuses: [Misuse; 3] = [
        |v| {
            v.superblock_begin(&SuperblockInfo::default())?;
            v.mapping(&Mapping::single(0, 0, 0))
        },
        |v| {
            v.superblock_begin(&SuperblockInfo::default())?;
            v.def_begin("1")?;
            v.reference("1")
        },
        |v| v.device_end(),
    ];
    for misuse in misuses {
        for human in [false, true] {
            let result = std::panic::catch_unwind(|| {
                let mut visitor: Box<dyn DumpVisitor> = if human {
                    Box::new(HumanWriter::new(Vec::new()))
                } else {
                    Box::new(XmlWriter::new(Vec::new()))
                };
                let _ = misuse(visitor.as_mut());
            });
            let message = result.expect_err("out of order must panic");
            let text = message
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert!(text.contains("out of order"), "{text}");
        }
    }
}
