//! Reads the tags of a dump, one at a time, with `quick-xml`: start, end and empty-element
//! tags with their attributes (entities resolved). Whitespace, comments, the XML declaration
//! and processing instructions are skipped; text, CDATA and DOCTYPE are errors.
//!
//! `quick-xml` reports byte offsets, not lines, so the input is read through [`LineCounter`],
//! which counts the newlines `quick-xml` consumes; an error names the line on which the
//! offending tag (or text) starts. Memory is bounded: one tag, comment or run of whitespace
//! may hold at most [`EVENT_LENGTH_MAX_BYTES`], and the buffers are reused from tag to tag.

use std::io::{self, BufRead, Read};
use std::ops::Range;

use quick_xml::events::{BytesStart, Event};

use crate::format::dump::{Error, ParseProblem};

/// The most bytes one tag, comment or run of whitespace between tags may hold.
pub(super) const EVENT_LENGTH_MAX_BYTES: usize = 4096;

/// What kind of tag the reader stopped at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TagKind {
    /// `<name ...>`
    Start,
    /// `</name>`
    End,
    /// `<name .../>`
    Empty,
}

/// Streams tags out of a `BufRead`.
pub(super) struct TagReader<R: BufRead> {
    reader: quick_xml::Reader<LineCounter<R>>,
    /// Reused buffer for the raw bytes of one event.
    buffer: Vec<u8>,
    /// Line on which the current tag starts.
    tag_line: u64,
    kind: TagKind,
    /// Name of the current tag followed by its attribute names and (unescaped) values.
    text: String,
    name: Range<usize>,
    attributes: Vec<(Range<usize>, Range<usize>)>,
}

impl<R: BufRead> TagReader<R> {
    pub(super) fn new(input: R) -> TagReader<R> {
        let mut reader = quick_xml::Reader::from_reader(LineCounter::new(input));
        let config = reader.config_mut();
        // The parser checks nesting itself, to name the open element in its errors.
        config.check_end_names = false;
        config.allow_unmatched_ends = true;
        config.expand_empty_elements = false;
        TagReader {
            reader,
            buffer: Vec::new(),
            tag_line: 1,
            kind: TagKind::Empty,
            text: String::new(),
            name: 0..0,
            attributes: Vec::new(),
        }
    }

    /// The line of the next unread byte (the last line, once the input has ended).
    pub(super) fn end_line(&self) -> u64 {
        self.reader.get_ref().line()
    }

    pub(super) fn kind(&self) -> TagKind {
        self.kind
    }

    pub(super) fn name(&self) -> &str {
        &self.text[self.name.clone()]
    }

    /// The attributes of the current tag, in document order.
    pub(super) fn attributes(&self) -> impl Iterator<Item = (&str, &str)> {
        self.attributes
            .iter()
            .map(|(name, value)| (&self.text[name.clone()], &self.text[value.clone()]))
    }

    /// An error at the current tag.
    pub(super) fn error(&self, problem: ParseProblem) -> Error {
        Error::Parse {
            line: self.tag_line,
            problem,
        }
    }

    /// Advances to the next tag. Returns `Ok(false)` at the end of the input.
    pub(super) fn next_tag(&mut self) -> Result<bool, Error> {
        loop {
            self.buffer.clear();
            self.tag_line = self.reader.get_ref().line();
            self.reader.get_mut().start_event();
            let event = match self.reader.read_event_into(&mut self.buffer) {
                Ok(event) => event,
                Err(error) => return Err(self.read_error(error)),
            };
            match event {
                Event::Start(start) => {
                    load(&mut self.text, &mut self.name, &mut self.attributes, &start)
                        .map_err(|problem| error_at(self.tag_line, problem))?;
                    self.kind = TagKind::Start;
                    return Ok(true);
                }
                Event::Empty(start) => {
                    load(&mut self.text, &mut self.name, &mut self.attributes, &start)
                        .map_err(|problem| error_at(self.tag_line, problem))?;
                    self.kind = TagKind::Empty;
                    return Ok(true);
                }
                Event::End(end) => {
                    self.text.clear();
                    self.attributes.clear();
                    push_name(&mut self.text, end.name().as_ref())
                        .map_err(|problem| error_at(self.tag_line, problem))?;
                    self.name = 0..self.text.len();
                    self.kind = TagKind::End;
                    return Ok(true);
                }
                Event::Text(text) => {
                    let Some(first) = text.find(|c: char| !c.is_ascii_whitespace()) else {
                        continue;
                    };
                    return Err(error_at(
                        self.tag_line + newlines(text[..first].as_bytes()),
                        ParseProblem::UnexpectedText,
                    ));
                }
                Event::GeneralRef(_) => {
                    return Err(error_at(self.tag_line, ParseProblem::UnexpectedText))
                }
                Event::Comment(_) | Event::Decl(_) | Event::PI(_) => continue,
                Event::CData(_) => return Err(self.syntax("CDATA is not part of a dump")),
                Event::DocType(_) => return Err(self.syntax("DOCTYPE is not part of a dump")),
                Event::Eof => return Ok(false),
            }
        }
    }

    fn syntax(&self, message: &str) -> Error {
        self.error(ParseProblem::Syntax(message.to_owned()))
    }

    /// Turns an error of `quick-xml` into ours, at the line where the event started.
    fn read_error(&self, error: quick_xml::Error) -> Error {
        if self.reader.get_ref().exceeded {
            return self.error(ParseProblem::TagTooLong {
                limit_bytes: EVENT_LENGTH_MAX_BYTES,
            });
        }
        match error {
            quick_xml::Error::Io(error) => Error::Io(
                std::sync::Arc::try_unwrap(error)
                    .unwrap_or_else(|shared| io::Error::new(shared.kind(), shared.to_string())),
            ),
            other => self.error(ParseProblem::Syntax(other.to_string())),
        }
    }
}

fn error_at(line: u64, problem: ParseProblem) -> Error {
    Error::Parse { line, problem }
}

/// Copies the name and the attributes of `start` into `text` (values unescaped), recording
/// their ranges.
fn load(
    text: &mut String,
    name: &mut Range<usize>,
    attributes: &mut Vec<(Range<usize>, Range<usize>)>,
    start: &BytesStart<'_>,
) -> Result<(), ParseProblem> {
    text.clear();
    attributes.clear();
    push_name(text, start.name().as_ref())?;
    *name = 0..text.len();
    let whole: &str = start;
    // Duplicates are the parser's to report, with the tag's name.
    for attribute in start.attributes().with_checks(false) {
        let attribute = attribute.map_err(|error| ParseProblem::Syntax(error.to_string()))?;
        let key = attribute.key.as_ref();
        // quick-xml accepts `a="1"b="2"`; XML wants whitespace between attributes.
        if !preceded_by_whitespace(whole, key) {
            return Err(ParseProblem::Syntax(
                "expected whitespace before an attribute".to_owned(),
            ));
        }
        let key_begin = text.len();
        push_name(text, key)?;
        let key_range = key_begin..text.len();
        let value = quick_xml::escape::unescape(&attribute.value)
            .map_err(|error| ParseProblem::Syntax(error.to_string()))?;
        let value_begin = text.len();
        text.push_str(&value);
        attributes.push((key_range, value_begin..text.len()));
    }
    Ok(())
}

/// Whether the byte before `part`, a slice borrowed from `whole`, is whitespace.
fn preceded_by_whitespace(whole: &str, part: &str) -> bool {
    let offset = (part.as_ptr() as usize).wrapping_sub(whole.as_ptr() as usize);
    offset
        .checked_sub(1)
        .and_then(|before| whole.as_bytes().get(before))
        .is_some_and(u8::is_ascii_whitespace)
}

/// Appends a tag or attribute name; names are ASCII letters, digits, `_`, `-`, `.` and `:`.
fn push_name(text: &mut String, name: &str) -> Result<(), ParseProblem> {
    let valid =
        |byte: &u8| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.' | b':');
    if name.is_empty() || !name.bytes().all(|byte| valid(&byte)) {
        return Err(ParseProblem::Syntax(format!("invalid name {name:?}")));
    }
    text.push_str(name);
    Ok(())
}

fn newlines(bytes: &[u8]) -> u64 {
    // usize to u64 never truncates on the platforms we build for.
    bytes.iter().filter(|&&byte| byte == b'\n').count() as u64
}

/// A `BufRead` that counts the newlines consumed through it, and refuses to hand out more
/// than [`EVENT_LENGTH_MAX_BYTES`] between two calls to [`LineCounter::start_event`].
struct LineCounter<R> {
    input: R,
    newlines: u64,
    /// Bytes the current event may still consume.
    budget: usize,
    /// Whether the current event ran past its budget.
    exceeded: bool,
}

impl<R: BufRead> LineCounter<R> {
    fn new(input: R) -> LineCounter<R> {
        LineCounter {
            input,
            newlines: 0,
            budget: EVENT_LENGTH_MAX_BYTES,
            exceeded: false,
        }
    }

    /// The line of the next unread byte (1-based).
    fn line(&self) -> u64 {
        self.newlines + 1
    }

    fn start_event(&mut self) {
        self.budget = EVENT_LENGTH_MAX_BYTES;
        self.exceeded = false;
    }
}

impl<R: BufRead> Read for LineCounter<R> {
    fn read(&mut self, output: &mut [u8]) -> io::Result<usize> {
        let available = self.fill_buf()?;
        let length = available.len().min(output.len());
        output[..length].copy_from_slice(&available[..length]);
        self.consume(length);
        Ok(length)
    }
}

impl<R: BufRead> BufRead for LineCounter<R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        let available = self.input.fill_buf()?;
        if self.budget == 0 && !available.is_empty() {
            self.exceeded = true;
            return Err(io::Error::other("xml event too long"));
        }
        Ok(&available[..available.len().min(self.budget)])
    }

    fn consume(&mut self, amount: usize) {
        if amount == 0 {
            return;
        }
        // The bytes being consumed are still in the input's buffer: this reads nothing.
        if let Ok(available) = self.input.fill_buf() {
            self.newlines += newlines(&available[..amount]);
        }
        self.budget = self.budget.saturating_sub(amount);
        self.input.consume(amount);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Tag = (TagKind, String, Vec<(String, String)>);

    fn tags(text: &str) -> Result<Vec<Tag>, Error> {
        let mut reader = TagReader::new(text.as_bytes());
        let mut tags = Vec::new();
        while reader.next_tag()? {
            let attributes = reader
                .attributes()
                .map(|(name, value)| (name.to_owned(), value.to_owned()))
                .collect();
            tags.push((reader.kind(), reader.name().to_owned(), attributes));
        }
        Ok(tags)
    }

    fn error(text: &str) -> (u64, ParseProblem) {
        match tags(text) {
            Err(Error::Parse { line, problem }) => (line, problem),
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn reads_start_end_and_empty_tags_with_attributes() {
        let found = tags("<?xml version=\"1.0\"?>\n<!-- a -- comment -->\n<a x=\"1\" y='&lt;&#65;&#x42;'>\n <b/>\n</a >").unwrap();
        assert_eq!(
            found,
            vec![
                (
                    TagKind::Start,
                    "a".to_owned(),
                    vec![
                        ("x".to_owned(), "1".to_owned()),
                        ("y".to_owned(), "<AB".to_owned())
                    ]
                ),
                (TagKind::Empty, "b".to_owned(), vec![]),
                (TagKind::End, "a".to_owned(), vec![]),
            ]
        );
    }

    #[test]
    fn lines_are_those_where_tags_start() {
        let mut reader = TagReader::new("<a>\n\n <b\n x=\"1\"/>\n<c/><d/>\n</a>\n".as_bytes());
        let mut lines = Vec::new();
        while reader.next_tag().unwrap() {
            lines.push((reader.name().to_owned(), reader.tag_line));
        }
        let expected = [("a", 1), ("b", 3), ("c", 5), ("d", 5), ("a", 6)];
        assert_eq!(
            lines,
            expected
                .map(|(name, line)| (name.to_owned(), line))
                .to_vec()
        );
        assert_eq!(reader.end_line(), 7);
    }

    #[test]
    fn text_between_tags_is_an_error_with_its_line() {
        assert_eq!(
            error("<a>\n\n  hello</a>"),
            (3, ParseProblem::UnexpectedText)
        );
        assert_eq!(error("<a>\n&amp;</a>"), (2, ParseProblem::UnexpectedText));
    }

    #[test]
    fn malformed_markup_is_a_syntax_error_on_the_tag_line() {
        for text in [
            "<a>\n<b x=\"1\"",
            "<a>\n<b x=1/>",
            "<a>\n<b x=\"1\"y=\"2\"/>",
            "<a>\n<b x=\"&nope;\"/>",
            "<a>\n<b x/>",
            "<a>\n<b\u{e9}/>",
            "<a>\n<![CDATA[x]]>",
            "<a>\n<!DOCTYPE a>",
        ] {
            let (line, problem) = error(text);
            assert_eq!(line, 2, "{text:?}");
            assert!(
                matches!(problem, ParseProblem::Syntax(_)),
                "{text:?}: {problem:?}"
            );
        }
    }

    #[test]
    fn overlong_tag_is_rejected() {
        let text = format!("<a>\n<b x=\"{}\"/>", "9".repeat(EVENT_LENGTH_MAX_BYTES + 1));
        assert_eq!(
            error(&text),
            (
                2,
                ParseProblem::TagTooLong {
                    limit_bytes: EVENT_LENGTH_MAX_BYTES
                }
            )
        );
        // A tag just under the limit is fine.
        let text = format!("<b x=\"{}\"/>", "9".repeat(EVENT_LENGTH_MAX_BYTES - 10));
        assert_eq!(tags(&text).unwrap().len(), 1);
    }
}
