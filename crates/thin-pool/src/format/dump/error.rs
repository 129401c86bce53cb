//! The error type of the dump module: output failures, XML parse problems (always with the
//! line they were found on) and failures reported by a visitor.

use std::fmt;

/// Errors from writing, parsing or visiting a dump.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Reading the input or writing the output failed.
    #[error("dump i/o failed")]
    Io(#[from] std::io::Error),
    /// The XML is malformed or does not describe a dump.
    #[error("line {line}: {problem}")]
    Parse {
        /// 1-based line on which the offending markup starts.
        line: u64,
        /// What is wrong.
        problem: ParseProblem,
    },
    /// The chosen output format cannot express this event (e.g. `<def>` in 0.9.0 XML).
    #[error("{what} cannot be written in the {format} format")]
    Unsupported {
        /// The event that cannot be written.
        what: &'static str,
        /// The output format.
        format: &'static str,
    },
    /// A visitor rejected an event (e.g. the restorer ran out of space).
    #[error("dump visitor failed")]
    Visitor(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// What is wrong with a piece of XML; [`Error::Parse`] adds the line.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseProblem {
    /// The markup itself is malformed (unterminated tag, missing `=`, bad entity, ...).
    Syntax(String),
    /// Non-whitespace text between elements.
    UnexpectedText,
    /// An element name the dump format does not have.
    UnknownTag(String),
    /// An attribute the element does not have.
    UnknownAttribute {
        /// Element name.
        tag: String,
        /// Attribute name.
        attribute: String,
    },
    /// The same attribute twice in one element.
    DuplicateAttribute {
        /// Element name.
        tag: String,
        /// Attribute name.
        attribute: String,
    },
    /// A required attribute is absent.
    MissingAttribute {
        /// Element name.
        tag: &'static str,
        /// Attribute name.
        attribute: &'static str,
    },
    /// An attribute value is not a decimal number of the right width.
    BadNumber {
        /// Attribute name.
        attribute: &'static str,
        /// The value as written.
        value: String,
        /// The largest value accepted.
        max: u64,
    },
    /// A `range_mapping` with `length="0"`.
    ZeroLength,
    /// A run whose last virtual or data block does not fit in 64 bits.
    RunOverflow,
    /// An element where it may not appear (e.g. a mapping outside a device).
    Misplaced {
        /// Element name.
        tag: String,
        /// Where it was found.
        context: &'static str,
    },
    /// An end tag that does not close the open element.
    MismatchedEnd {
        /// The element that is open (empty at top level).
        expected: String,
        /// The end tag found.
        found: String,
    },
    /// A `<ref>` naming no earlier `<def>`.
    UndefinedReference(String),
    /// A second `<def>` with the same name.
    DuplicateDefinition(String),
    /// The input ended inside an element, or before any superblock.
    UnexpectedEnd {
        /// The innermost open element, or empty if none was opened.
        open: String,
    },
    /// A tag longer than the parser's limit.
    TagTooLong {
        /// The limit in bytes.
        limit_bytes: usize,
    },
}

impl fmt::Display for ParseProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseProblem::Syntax(message) => write!(f, "malformed xml: {message}"),
            ParseProblem::UnexpectedText => write!(f, "unexpected text between elements"),
            ParseProblem::UnknownTag(tag) => write!(f, "unknown tag <{tag}>"),
            ParseProblem::UnknownAttribute { tag, attribute } => {
                write!(f, "unknown attribute '{attribute}' in <{tag}>")
            }
            ParseProblem::DuplicateAttribute { tag, attribute } => {
                write!(f, "attribute '{attribute}' repeated in <{tag}>")
            }
            ParseProblem::MissingAttribute { tag, attribute } => {
                write!(f, "<{tag}> is missing attribute '{attribute}'")
            }
            ParseProblem::BadNumber {
                attribute,
                value,
                max,
            } => write!(
                f,
                "attribute '{attribute}' is not a number in 0..={max}: {value:?}"
            ),
            ParseProblem::ZeroLength => write!(f, "range_mapping with length 0"),
            ParseProblem::RunOverflow => write!(f, "mapping run extends past block 2^64 - 1"),
            ParseProblem::Misplaced { tag, context } => write!(f, "<{tag}> {context}"),
            ParseProblem::MismatchedEnd { expected, found } if expected.is_empty() => {
                write!(f, "end tag </{found}> with no open element")
            }
            ParseProblem::MismatchedEnd { expected, found } => {
                write!(f, "end tag </{found}> does not close <{expected}>")
            }
            ParseProblem::UndefinedReference(name) => {
                write!(f, "<ref name=\"{name}\"/> names no earlier <def>")
            }
            ParseProblem::DuplicateDefinition(name) => {
                write!(f, "<def name=\"{name}\"> defined twice")
            }
            ParseProblem::UnexpectedEnd { open } if open.is_empty() => {
                write!(f, "input ended before a <superblock>")
            }
            ParseProblem::UnexpectedEnd { open } => write!(f, "input ended inside <{open}>"),
            ParseProblem::TagTooLong { limit_bytes } => {
                write!(f, "tag longer than {limit_bytes} bytes")
            }
        }
    }
}
