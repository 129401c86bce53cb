//! A small streaming XML tokenizer for the dump format: it yields one tag at a time (start,
//! end or empty-element tag with its attributes), skips whitespace, comments and processing
//! instructions (`<?xml ...?>`), and rejects everything else (text, CDATA, DOCTYPE).
//!
//! Memory is bounded: a tag may hold at most [`TAG_LENGTH_MAX_BYTES`] bytes of names and
//! values, and the buffers are reused from tag to tag. Line numbers are counted as bytes are
//! consumed, so errors name the line on which the offending tag starts.

use std::io::BufRead;
use std::ops::Range;

use crate::format::dump::{Error, ParseProblem};

/// The most bytes of names and attribute values one tag may hold.
pub(super) const TAG_LENGTH_MAX_BYTES: usize = 4096;

/// Longest entity name accepted between `&` and `;` (e.g. `#x10FFFF`).
const ENTITY_LENGTH_MAX_BYTES: usize = 10;

/// What kind of tag the lexer stopped at.
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
pub(super) struct Lexer<R> {
    input: R,
    /// Line of the next unread byte (1-based).
    line: u64,
    /// Line on which the current tag starts.
    tag_line: u64,
    kind: TagKind,
    /// Name of the current tag followed by its attribute names and (unescaped) values.
    text: String,
    name: Range<usize>,
    attributes: Vec<(Range<usize>, Range<usize>)>,
    /// Reused buffer for one raw attribute value.
    value: Vec<u8>,
}

impl<R: BufRead> Lexer<R> {
    pub(super) fn new(input: R) -> Lexer<R> {
        Lexer {
            input,
            line: 1,
            tag_line: 1,
            kind: TagKind::Empty,
            text: String::new(),
            name: 0..0,
            attributes: Vec::new(),
            value: Vec::new(),
        }
    }

    /// The line of the next unread byte (the last line, once the input has ended).
    pub(super) fn end_line(&self) -> u64 {
        self.line
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

    fn syntax(&self, message: &str) -> Error {
        self.error(ParseProblem::Syntax(message.to_owned()))
    }

    /// Advances to the next tag. Returns `Ok(false)` at the end of the input.
    pub(super) fn next_tag(&mut self) -> Result<bool, Error> {
        loop {
            match self.next_byte()? {
                None => return Ok(false),
                Some(b'<') => {}
                Some(byte) if byte.is_ascii_whitespace() => continue,
                Some(_) => {
                    return Err(Error::Parse {
                        line: self.line,
                        problem: ParseProblem::UnexpectedText,
                    })
                }
            }
            self.tag_line = self.line;
            match self.expect_byte()? {
                b'?' => self.skip_until(b"?>")?,
                b'!' => {
                    if self.expect_byte()? != b'-' || self.expect_byte()? != b'-' {
                        return Err(self.syntax("only comments may start with '<!'"));
                    }
                    self.skip_until(b"-->")?;
                }
                b'/' => {
                    self.start_tag(TagKind::End);
                    let first = self.expect_byte()?;
                    let end = self.read_name(first)?;
                    self.name = 0..self.text.len();
                    if self.skip_whitespace(end)? != b'>' {
                        return Err(self.syntax("expected '>' after the end tag's name"));
                    }
                    return Ok(true);
                }
                first => {
                    self.start_tag(TagKind::Start);
                    self.read_start_tag(first)?;
                    return Ok(true);
                }
            }
        }
    }

    fn start_tag(&mut self, kind: TagKind) {
        self.kind = kind;
        self.text.clear();
        self.attributes.clear();
    }

    /// Reads the rest of `<name attr="value" ...>` or `.../>`, `first` being the byte after `<`.
    fn read_start_tag(&mut self, first: u8) -> Result<(), Error> {
        let mut next = self.read_name(first)?;
        self.name = 0..self.text.len();
        loop {
            let had_space = next.is_ascii_whitespace();
            next = self.skip_whitespace(next)?;
            match next {
                b'>' => return Ok(()),
                b'/' => {
                    if self.expect_byte()? != b'>' {
                        return Err(self.syntax("expected '>' after '/'"));
                    }
                    self.kind = TagKind::Empty;
                    return Ok(());
                }
                _ if !had_space => {
                    return Err(self.syntax("expected whitespace before an attribute"));
                }
                _ => {}
            }
            let name_begin = self.text.len();
            next = self.read_name(next)?;
            let name = name_begin..self.text.len();
            if self.skip_whitespace(next)? != b'=' {
                return Err(self.syntax("expected '=' after an attribute name"));
            }
            let next_after_equals = self.expect_byte()?;
            let quote = self.skip_whitespace(next_after_equals)?;
            if quote != b'"' && quote != b'\'' {
                return Err(self.syntax("expected a quoted attribute value"));
            }
            let value_begin = self.text.len();
            self.read_value(quote)?;
            self.attributes.push((name, value_begin..self.text.len()));
            next = self.expect_byte()?;
        }
    }

    /// Reads a name starting with `first`; returns the byte after it.
    fn read_name(&mut self, first: u8) -> Result<u8, Error> {
        let mut byte = first;
        let begin = self.text.len();
        while byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.' | b':') {
            self.push_char(char::from(byte))?;
            byte = self.expect_byte()?;
        }
        if self.text.len() == begin {
            return Err(self.syntax(&format!("expected a name, found {:?}", char::from(byte))));
        }
        Ok(byte)
    }

    /// Reads an attribute value up to the closing `quote`, resolving entities.
    fn read_value(&mut self, quote: u8) -> Result<(), Error> {
        let mut bytes = std::mem::take(&mut self.value);
        bytes.clear();
        let result = self.read_value_into(quote, &mut bytes);
        self.value = bytes;
        result
    }

    fn read_value_into(&mut self, quote: u8, bytes: &mut Vec<u8>) -> Result<(), Error> {
        loop {
            match self.expect_byte()? {
                byte if byte == quote => break,
                b'<' => return Err(self.syntax("'<' inside an attribute value")),
                b'&' => {
                    let character = self.read_entity()?;
                    let mut encoded = [0; 4];
                    bytes.extend_from_slice(character.encode_utf8(&mut encoded).as_bytes());
                }
                byte => bytes.push(byte),
            }
            if self.text.len() + bytes.len() > TAG_LENGTH_MAX_BYTES {
                return Err(self.error(ParseProblem::TagTooLong {
                    limit_bytes: TAG_LENGTH_MAX_BYTES,
                }));
            }
        }
        let value = std::str::from_utf8(bytes)
            .map_err(|_| self.syntax("attribute value is not valid utf-8"))?;
        self.text.push_str(value);
        Ok(())
    }

    /// Reads `name;` after `&` and returns the character it stands for.
    fn read_entity(&mut self) -> Result<char, Error> {
        let mut name = [0u8; ENTITY_LENGTH_MAX_BYTES];
        let mut length = 0;
        loop {
            let byte = self.expect_byte()?;
            if byte == b';' {
                break;
            }
            if length == name.len() {
                return Err(self.syntax("unterminated entity reference"));
            }
            name[length] = byte;
            length += 1;
        }
        let name = &name[..length];
        let character = match name {
            b"amp" => Some('&'),
            b"lt" => Some('<'),
            b"gt" => Some('>'),
            b"quot" => Some('"'),
            b"apos" => Some('\''),
            [b'#', b'x', hex @ ..] => std::str::from_utf8(hex)
                .ok()
                .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                .and_then(char::from_u32),
            [b'#', decimal @ ..] => std::str::from_utf8(decimal)
                .ok()
                .and_then(|decimal| decimal.parse::<u32>().ok())
                .and_then(char::from_u32),
            _ => None,
        };
        character.ok_or_else(|| {
            self.syntax(&format!(
                "unknown entity '&{};'",
                String::from_utf8_lossy(name)
            ))
        })
    }

    fn push_char(&mut self, character: char) -> Result<(), Error> {
        if self.text.len() >= TAG_LENGTH_MAX_BYTES {
            return Err(self.error(ParseProblem::TagTooLong {
                limit_bytes: TAG_LENGTH_MAX_BYTES,
            }));
        }
        self.text.push(character);
        Ok(())
    }

    /// Skips whitespace starting at `byte`; returns the first other byte.
    fn skip_whitespace(&mut self, mut byte: u8) -> Result<u8, Error> {
        while byte.is_ascii_whitespace() {
            byte = self.expect_byte()?;
        }
        Ok(byte)
    }

    /// Skips bytes up to and including `terminator` (a comment or processing instruction).
    fn skip_until(&mut self, terminator: &[u8]) -> Result<(), Error> {
        let mut matched = 0;
        while matched < terminator.len() {
            let byte = self.expect_byte()?;
            if byte == terminator[matched] {
                matched += 1;
            } else {
                matched = usize::from(byte == terminator[0]);
            }
        }
        Ok(())
    }

    /// The next byte; the input must not end inside a tag.
    fn expect_byte(&mut self) -> Result<u8, Error> {
        self.next_byte()?
            .ok_or_else(|| self.syntax("input ended inside a tag"))
    }

    fn next_byte(&mut self) -> Result<Option<u8>, Error> {
        let buffer = loop {
            match self.input.fill_buf() {
                Ok(buffer) => break buffer,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(Error::Io(error)),
            }
        };
        let Some(&byte) = buffer.first() else {
            return Ok(None);
        };
        self.input.consume(1);
        if byte == b'\n' {
            self.line += 1;
        }
        Ok(Some(byte))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Tag = (TagKind, String, Vec<(String, String)>);

    fn tags(text: &str) -> Result<Vec<Tag>, Error> {
        let mut lexer = Lexer::new(text.as_bytes());
        let mut tags = Vec::new();
        while lexer.next_tag()? {
            let attributes = lexer
                .attributes()
                .map(|(name, value)| (name.to_owned(), value.to_owned()))
                .collect();
            tags.push((lexer.kind(), lexer.name().to_owned(), attributes));
        }
        Ok(tags)
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
    fn text_between_tags_is_an_error_with_its_line() {
        let error = tags("<a>\n\n  hello</a>").unwrap_err();
        assert!(
            matches!(
                error,
                Error::Parse {
                    line: 3,
                    problem: ParseProblem::UnexpectedText
                }
            ),
            "{error:?}"
        );
    }

    #[test]
    fn unterminated_tag_is_a_syntax_error() {
        let error = tags("<a x=\"1\"").unwrap_err();
        assert!(matches!(
            error,
            Error::Parse {
                line: 1,
                problem: ParseProblem::Syntax(_)
            }
        ));
    }

    #[test]
    fn overlong_tag_is_rejected() {
        let text = format!("<a x=\"{}\"/>", "9".repeat(TAG_LENGTH_MAX_BYTES + 1));
        let error = tags(&text).unwrap_err();
        assert!(matches!(
            error,
            Error::Parse {
                problem: ParseProblem::TagTooLong { .. },
                ..
            }
        ));
    }
}
