//! The streaming XML parser: reads a 0.9.0 or 1.x dump tag by tag (tags from
//! [`TagReader`], over `quick-xml`) and drives a [`DumpVisitor`]. Memory does not grow with
//! the number of mappings or devices; it grows only with the number of `<def>` names, which
//! must be remembered to check `<ref>`s.

use std::collections::HashSet;
use std::io::BufRead;

use super::reader::{TagKind, TagReader};
use crate::format::dump::{DeviceInfo, DumpVisitor, Error, Mapping, ParseProblem, SuperblockInfo};

/// The `version` a superblock gets when the XML leaves it out (as 1.x `thin_restore` does).
const VERSION_DEFAULT: u32 = 2;

/// Where the parser is in the document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Top,
    Superblock,
    Def,
    Device,
    Done,
}

impl State {
    /// The element that is open, or `""` outside the superblock.
    fn open_tag(self) -> &'static str {
        match self {
            State::Top | State::Done => "",
            State::Superblock => "superblock",
            State::Def => "def",
            State::Device => "device",
        }
    }
}

/// Parses a dump in `thin_dump` XML (0.9.0 or 1.x) from `input`, calling `visitor` for every
/// element as it is read.
///
/// Accepts an XML declaration and comments, and both `<x .../>` and `<x ...></x>` forms.
/// Rejects, with the line number: malformed markup, text between elements, unknown tags and
/// attributes, missing or repeated attributes, numbers that do not fit, mappings outside a
/// device or definition, references to undefined definitions, mismatched end tags, a tag,
/// comment or run of whitespace longer than 4096 bytes, and input that ends early or
/// continues after `</superblock>`. A missing `flags` reads as 0
/// and a missing `version` as 2. Errors from the visitor are returned unchanged.
pub fn parse<R: BufRead>(input: R, visitor: &mut dyn DumpVisitor) -> Result<(), Error> {
    let mut reader = TagReader::new(input);
    let mut state = State::Top;
    // A mapping or ref written as a start tag, whose end tag must come next.
    let mut open_leaf: Option<&'static str> = None;
    let mut definitions: HashSet<String> = HashSet::new();

    while reader.next_tag()? {
        if let Some(leaf) = open_leaf.take() {
            if reader.kind() != TagKind::End || reader.name() != leaf {
                return Err(reader.error(ParseProblem::MismatchedEnd {
                    expected: leaf.to_owned(),
                    found: reader.name().to_owned(),
                }));
            }
            continue;
        }
        if reader.kind() == TagKind::End {
            if reader.name() != state.open_tag() {
                return Err(reader.error(ParseProblem::MismatchedEnd {
                    expected: state.open_tag().to_owned(),
                    found: reader.name().to_owned(),
                }));
            }
            state = close(state, visitor)?;
            continue;
        }
        let empty = reader.kind() == TagKind::Empty;
        match start_tag(&reader, state, &mut definitions, visitor)? {
            Opened::Element(inside) => {
                state = inside;
                if empty {
                    state = close(state, visitor)?;
                }
            }
            Opened::Leaf(name) => {
                if !empty {
                    open_leaf = Some(name);
                }
            }
        }
    }

    let open = match open_leaf {
        Some(leaf) => leaf,
        None => state.open_tag(),
    };
    if state == State::Done && open_leaf.is_none() {
        return Ok(());
    }
    Err(Error::Parse {
        line: reader.end_line(),
        problem: ParseProblem::UnexpectedEnd {
            open: open.to_owned(),
        },
    })
}

/// What a start tag opened: an element that holds others (the state inside it), or a leaf
/// element (a mapping or a reference, by tag name) whose end tag must come next unless it
/// was written empty.
enum Opened {
    Element(State),
    Leaf(&'static str),
}

/// Handle the start tag `reader` is at, in `state`: check where it is, tell the visitor.
fn start_tag<R: BufRead>(
    reader: &TagReader<R>,
    state: State,
    definitions: &mut HashSet<String>,
    visitor: &mut dyn DumpVisitor,
) -> Result<Opened, Error> {
    match reader.name() {
        "superblock" => {
            if state != State::Top {
                return Err(misplaced(reader, "may appear only once, at the top"));
            }
            visitor.superblock_begin(&superblock(reader)?)?;
            Ok(Opened::Element(State::Superblock))
        }
        "def" => {
            if state != State::Superblock {
                return Err(misplaced(reader, "must be directly inside <superblock>"));
            }
            let [name] = attributes(reader, "def", ["name"])?;
            let name = required(reader, "def", "name", name)?;
            if !definitions.insert(name.to_owned()) {
                return Err(reader.error(ParseProblem::DuplicateDefinition(name.to_owned())));
            }
            visitor.def_begin(name)?;
            Ok(Opened::Element(State::Def))
        }
        "device" => {
            if state != State::Superblock {
                return Err(misplaced(reader, "must be directly inside <superblock>"));
            }
            visitor.device_begin(&device(reader)?)?;
            Ok(Opened::Element(State::Device))
        }
        "single_mapping" | "range_mapping" => {
            if !matches!(state, State::Def | State::Device) {
                return Err(misplaced(reader, "outside a <device> or <def>"));
            }
            visitor.mapping(&mapping(reader)?)?;
            Ok(Opened::Leaf(leaf_name(reader.name())))
        }
        "ref" => {
            if state != State::Device {
                return Err(misplaced(reader, "outside a <device>"));
            }
            let [name] = attributes(reader, "ref", ["name"])?;
            let name = required(reader, "ref", "name", name)?;
            if !definitions.contains(name) {
                return Err(reader.error(ParseProblem::UndefinedReference(name.to_owned())));
            }
            visitor.reference(name)?;
            Ok(Opened::Leaf("ref"))
        }
        other => Err(reader.error(ParseProblem::UnknownTag(other.to_owned()))),
    }
}

/// Closes the open element; returns the state after it.
fn close(state: State, visitor: &mut dyn DumpVisitor) -> Result<State, Error> {
    Ok(match state {
        State::Superblock => {
            visitor.superblock_end()?;
            State::Done
        }
        State::Def => {
            visitor.def_end()?;
            State::Superblock
        }
        State::Device => {
            visitor.device_end()?;
            State::Superblock
        }
        State::Top | State::Done => unreachable!("no element is open in state {state:?}"),
    })
}

fn leaf_name(name: &str) -> &'static str {
    if name == "single_mapping" {
        "single_mapping"
    } else {
        "range_mapping"
    }
}

fn misplaced<R: BufRead>(reader: &TagReader<R>, context: &'static str) -> Error {
    reader.error(ParseProblem::Misplaced {
        tag: reader.name().to_owned(),
        context,
    })
}

fn superblock<R: BufRead>(reader: &TagReader<R>) -> Result<SuperblockInfo, Error> {
    const TAG: &str = "superblock";
    let [uuid, time, transaction, flags, version, data_block_size, nr_data_blocks, metadata_snap] =
        attributes(
            reader,
            TAG,
            [
                "uuid",
                "time",
                "transaction",
                "flags",
                "version",
                "data_block_size",
                "nr_data_blocks",
                "metadata_snap",
            ],
        )?;
    Ok(SuperblockInfo {
        uuid: required(reader, TAG, "uuid", uuid)?.to_owned(),
        time: number_u32(reader, "time", required(reader, TAG, "time", time)?)?,
        transaction: number(
            reader,
            "transaction",
            required(reader, TAG, "transaction", transaction)?,
        )?,
        flags: flags.map_or(Ok(0), |flags| number_u32(reader, "flags", flags))?,
        version: version.map_or(Ok(VERSION_DEFAULT), |version| {
            number_u32(reader, "version", version)
        })?,
        data_block_size_sectors: number_u32(
            reader,
            "data_block_size",
            required(reader, TAG, "data_block_size", data_block_size)?,
        )?,
        data_block_count: number(
            reader,
            "nr_data_blocks",
            required(reader, TAG, "nr_data_blocks", nr_data_blocks)?,
        )?,
        metadata_snap: metadata_snap
            .map(|block| number(reader, "metadata_snap", block))
            .transpose()?,
    })
}

fn device<R: BufRead>(reader: &TagReader<R>) -> Result<DeviceInfo, Error> {
    const TAG: &str = "device";
    let [dev_id, mapped_blocks, transaction, creation_time, snap_time] = attributes(
        reader,
        TAG,
        [
            "dev_id",
            "mapped_blocks",
            "transaction",
            "creation_time",
            "snap_time",
        ],
    )?;
    Ok(DeviceInfo {
        dev_id: number_u32(reader, "dev_id", required(reader, TAG, "dev_id", dev_id)?)?,
        mapped_block_count: number(
            reader,
            "mapped_blocks",
            required(reader, TAG, "mapped_blocks", mapped_blocks)?,
        )?,
        transaction: number(
            reader,
            "transaction",
            required(reader, TAG, "transaction", transaction)?,
        )?,
        creation_time: number_u32(
            reader,
            "creation_time",
            required(reader, TAG, "creation_time", creation_time)?,
        )?,
        snap_time: number_u32(
            reader,
            "snap_time",
            required(reader, TAG, "snap_time", snap_time)?,
        )?,
    })
}

fn mapping<R: BufRead>(reader: &TagReader<R>) -> Result<Mapping, Error> {
    let mapping = if reader.name() == "single_mapping" {
        const TAG: &str = "single_mapping";
        let [origin_block, data_block, time] =
            attributes(reader, TAG, ["origin_block", "data_block", "time"])?;
        Mapping::single(
            number(
                reader,
                "origin_block",
                required(reader, TAG, "origin_block", origin_block)?,
            )?,
            number(
                reader,
                "data_block",
                required(reader, TAG, "data_block", data_block)?,
            )?,
            number_u32(reader, "time", required(reader, TAG, "time", time)?)?,
        )
    } else {
        const TAG: &str = "range_mapping";
        let [origin_begin, data_begin, length, time] = attributes(
            reader,
            TAG,
            ["origin_begin", "data_begin", "length", "time"],
        )?;
        let mapping = Mapping {
            virtual_begin: number(
                reader,
                "origin_begin",
                required(reader, TAG, "origin_begin", origin_begin)?,
            )?,
            data_begin: number(
                reader,
                "data_begin",
                required(reader, TAG, "data_begin", data_begin)?,
            )?,
            length: number(reader, "length", required(reader, TAG, "length", length)?)?,
            time: number_u32(reader, "time", required(reader, TAG, "time", time)?)?,
        };
        if mapping.length == 0 {
            return Err(reader.error(ParseProblem::ZeroLength));
        }
        mapping
    };
    let last = mapping.length - 1;
    if mapping.virtual_begin.checked_add(last).is_none()
        || mapping.data_begin.checked_add(last).is_none()
    {
        return Err(reader.error(ParseProblem::RunOverflow));
    }
    Ok(mapping)
}

/// The values of the attributes `names` of the current tag, in that order. Unknown and
/// repeated attributes are errors.
fn attributes<'l, R: BufRead, const N: usize>(
    reader: &'l TagReader<R>,
    tag: &'static str,
    names: [&'static str; N],
) -> Result<[Option<&'l str>; N], Error> {
    let mut values = [None; N];
    for (name, value) in reader.attributes() {
        let Some(index) = names.iter().position(|known| *known == name) else {
            return Err(reader.error(ParseProblem::UnknownAttribute {
                tag: tag.to_owned(),
                attribute: name.to_owned(),
            }));
        };
        if values[index].replace(value).is_some() {
            return Err(reader.error(ParseProblem::DuplicateAttribute {
                tag: tag.to_owned(),
                attribute: name.to_owned(),
            }));
        }
    }
    Ok(values)
}

fn required<'v, R: BufRead>(
    reader: &TagReader<R>,
    tag: &'static str,
    attribute: &'static str,
    value: Option<&'v str>,
) -> Result<&'v str, Error> {
    value.ok_or_else(|| reader.error(ParseProblem::MissingAttribute { tag, attribute }))
}

/// Parses a plain decimal `u64` (digits only: no sign, spaces or prefix).
fn number<R: BufRead>(
    reader: &TagReader<R>,
    attribute: &'static str,
    value: &str,
) -> Result<u64, Error> {
    bounded(reader, attribute, value, u64::MAX)
}

fn number_u32<R: BufRead>(
    reader: &TagReader<R>,
    attribute: &'static str,
    value: &str,
) -> Result<u32, Error> {
    let number = bounded(reader, attribute, value, u64::from(u32::MAX))?;
    Ok(u32::try_from(number).expect("bounded by u32::MAX"))
}

fn bounded<R: BufRead>(
    reader: &TagReader<R>,
    attribute: &'static str,
    value: &str,
    max: u64,
) -> Result<u64, Error> {
    let parsed = if !value.is_empty() && value.bytes().all(|byte| byte.is_ascii_digit()) {
        value.parse::<u64>().ok().filter(|number| *number <= max)
    } else {
        None
    };
    parsed.ok_or_else(|| {
        reader.error(ParseProblem::BadNumber {
            attribute,
            value: value.to_owned(),
            max,
        })
    })
}
