//! Fixed-newstyle negotiation: greeting, client flags and the option loop, ending in
//! transmission, an abort or a hang-up.
//!
//! Owns the per-connection negotiation state (structured replies, extended headers, the
//! selected metadata contexts and the export they were selected for). Invariants: option data is
//! never read beyond [`OPTION_DATA_LENGTH_MAX`] bytes (larger options get `ERR_TOO_BIG` and the
//! connection closes); malformed option data gets `ERR_INVALID` and the loop goes on; unknown
//! options get `ERR_UNSUP`; at most [`OPTIONS_MAX`] options are answered per connection. The
//! transmission flags sent for INFO and GO are computed by one function from the export and
//! the negotiated state, so INFO and GO agree.
//!
//! STARTTLS (when the server has [`Tls`]): ACK, then the transport switches to TLS and every
//! negotiated state is forgotten (structured replies, extended headers, metadata contexts);
//! a second STARTTLS gets `ERR_INVALID`; there is no way back to plaintext. Under
//! [`TlsMode::Require`], before TLS every option but STARTTLS and ABORT gets `ERR_TLS_REQD`,
//! and EXPORT_NAME (which cannot carry an error) closes the connection. Client-supplied strings reach error messages
//! (and so the server's logs) only through [`quoted`]: escaped and at most
//! [`QUOTED_CHARS_MAX`] characters, so one connection cannot write kilobytes into a log line.
//!
//! Metadata-context queries, for every namespace this server serves: a query that ends in
//! `:` (a namespace such as `base:`, or a longer prefix such as `x-thinpool:diff:`) is a
//! wildcard for NBD_OPT_LIST_META_CONTEXT, listing every context whose name starts with it,
//! and selects nothing in NBD_OPT_SET_META_CONTEXT (as the protocol recommends); any other
//! query names one context exactly. Unknown names and namespaces are ignored, never an error.
//! A LIST without queries lists every context of the export. One SET selects at most
//! [`CONTEXTS_SELECTED_MAX`] distinct contexts (more get `ERR_TOO_BIG`), each with its own id;
//! a LIST or SET with more than [`CONTEXT_QUERIES_MAX`] queries gets `ERR_TOO_BIG`, so one
//! option costs a bounded number of export lookups.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::export::{Export, ExportRegistry, MetaContext};
use crate::protocol::{
    self, encode_option_reply, info, option, reply, transmission_flags, ExportRequest,
    MetaContextRequest, OptionHeader, BLOCK_SIZE_MIN, BLOCK_SIZE_PREFERRED, OPTION_DATA_LENGTH_MAX,
    OPTION_HEADER_SIZE, PAYLOAD_LENGTH_MAX,
};
use crate::stream::read_exact_or_eof;
use crate::tls::{Tls, TlsMode, Transport};

/// Most options answered on one connection before the server hangs up.
pub const OPTIONS_MAX: u32 = 4096;

/// Most metadata contexts one NBD_OPT_SET_META_CONTEXT may select: each one adds a chunk,
/// and a lookup, to every BLOCK_STATUS reply of the connection.
pub const CONTEXTS_SELECTED_MAX: usize = 16;

/// Most queries one NBD_OPT_LIST_META_CONTEXT or NBD_OPT_SET_META_CONTEXT may carry.
pub const CONTEXT_QUERIES_MAX: usize = 4 * CONTEXTS_SELECTED_MAX;

/// Most characters of a client-supplied string that [`quoted`] keeps.
pub(crate) const QUOTED_CHARS_MAX: usize = 64;

/// `text` in double quotes for a log line or an error message: control, format and other
/// non-printing characters escaped (U+202E becomes `\u{202e}`), cut after
/// [`QUOTED_CHARS_MAX`] characters with the full length noted.
pub(crate) fn quoted(text: &str) -> String {
    let mut out = String::from("\"");
    for character in text.chars().take(QUOTED_CHARS_MAX) {
        out.extend(character.escape_debug());
    }
    out.push('"');
    if text.chars().nth(QUOTED_CHARS_MAX).is_some() {
        out.push_str(&format!("... ({} bytes)", text.len()));
    }
    out
}

/// At most the first [`QUOTED_CHARS_MAX`] characters of `text` (for events, whose handler
/// escapes them when it logs).
pub(crate) fn truncated(text: &str) -> String {
    match text.char_indices().nth(QUOTED_CHARS_MAX) {
        Some((end, _)) => text[..end].to_owned(),
        None => text.to_owned(),
    }
}

/// Reply format agreed for the transmission phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplyStyle {
    /// Only simple replies.
    Simple,
    /// NBD_OPT_STRUCTURED_REPLY: structured chunks with compact headers.
    Structured,
    /// NBD_OPT_EXTENDED_HEADERS: 32-byte requests and extended chunks.
    Extended,
}

/// Where the status of a selected metadata context comes from.
#[derive(Clone)]
pub(crate) enum ContextSource {
    /// `base:allocation`: [`Export::block_status`].
    BaseAllocation,
    /// A context the export offers, bound when it was selected.
    Export(Arc<dyn MetaContext>),
}

/// A metadata context selected with NBD_OPT_SET_META_CONTEXT.
#[derive(Clone)]
pub(crate) struct SelectedContext {
    /// The id the client was given for it; unique within the connection.
    pub(crate) id: u32,
    pub(crate) source: ContextSource,
}

/// What the transmission phase needs from negotiation.
pub(crate) struct Negotiated {
    pub(crate) export: Arc<dyn Export>,
    pub(crate) style: ReplyStyle,
    /// Contexts selected for this export, in the order their ids were given; empty if none.
    pub(crate) contexts: Vec<SelectedContext>,
    /// Name the client used to select the export, cut to [`QUOTED_CHARS_MAX`] characters (for
    /// logs and events).
    pub(crate) requested_name: String,
    /// The client asked for NBD_INFO_BLOCK_SIZE in its GO, and so agreed to keep to the
    /// 512-byte minimum; a client that did not (or used EXPORT_NAME) may send requests of
    /// any alignment, served by [`crate::export::Unaligned`].
    pub(crate) block_sizes: bool,
}

/// How negotiation ended.
pub(crate) enum Outcome {
    Transmission(Negotiated),
    /// NBD_OPT_ABORT or a clean hang-up.
    Closed,
}

/// Negotiation state of one connection.
struct Handshake<'a, S> {
    stream: &'a mut S,
    registry: &'a dyn ExportRegistry,
    shutting_down: &'a AtomicBool,
    tls: Option<&'a Tls>,
    /// STARTTLS succeeded: everything since goes through TLS.
    tls_started: bool,
    fixed_newstyle: bool,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    /// Export name of the last SET_META_CONTEXT and the contexts it selected.
    meta_selection: Option<(String, Vec<SelectedContext>)>,
    next_context_id: u32,
    /// Unknown exports logged at info so far; past [`UNKNOWN_EXPORTS_LOGGED_MAX`], debug.
    unknown_exports_logged: std::cell::Cell<u32>,
}

/// Unknown export names one handshake logs at info; the rest (up to [`OPTIONS_MAX`]) go to
/// debug, so one client cannot fill the log.
const UNKNOWN_EXPORTS_LOGGED_MAX: u32 = 4;

/// Runs the handshake on `stream` until transmission starts or the client leaves.
pub(crate) fn negotiate<S: Transport>(
    stream: &mut S,
    registry: &dyn ExportRegistry,
    shutting_down: &AtomicBool,
    tls: Option<&Tls>,
) -> Result<Outcome> {
    stream
        .write_all(&protocol::encode_greeting())
        .map_err(|error| Error::io("send greeting", error))?;
    negotiate_after_greeting(stream, registry, shutting_down, tls)
}

/// [`negotiate`] once the greeting is out (the event loop's accept loop sends it).
pub(crate) fn negotiate_after_greeting<S: Transport>(
    stream: &mut S,
    registry: &dyn ExportRegistry,
    shutting_down: &AtomicBool,
    tls: Option<&Tls>,
) -> Result<Outcome> {
    let mut flags = [0u8; 4];
    if !read_exact_or_eof(stream, &mut flags).map_err(|e| Error::io("read client flags", e))? {
        return Ok(Outcome::Closed);
    }
    let client = protocol::parse_client_flags(flags)?;
    let mut handshake = Handshake {
        stream,
        registry,
        shutting_down,
        tls,
        tls_started: false,
        fixed_newstyle: client.fixed_newstyle,
        no_zeroes: client.no_zeroes,
        structured: false,
        extended: false,
        meta_selection: None,
        next_context_id: 1,
        unknown_exports_logged: std::cell::Cell::new(0),
    };
    handshake.option_loop()
}

impl<S: Transport> Handshake<'_, S> {
    fn option_loop(&mut self) -> Result<Outcome> {
        for _ in 0..OPTIONS_MAX {
            let mut header = [0u8; OPTION_HEADER_SIZE];
            let open = read_exact_or_eof(self.stream, &mut header)
                .map_err(|e| Error::io("read option header", e))?;
            if !open {
                return Ok(Outcome::Closed);
            }
            let header = OptionHeader::parse(&header)?;
            if !self.fixed_newstyle && header.code != option::EXPORT_NAME {
                return Err(Error::protocol(format!(
                    "option {} from a client without fixed newstyle",
                    header.code
                )));
            }
            if header.length > OPTION_DATA_LENGTH_MAX {
                if self.fixed_newstyle {
                    // Best effort: the connection closes whatever happens.
                    let _ = self.reply(header.code, reply::ERR_TOO_BIG, b"option data too long");
                }
                return Err(Error::TooLong {
                    what: "option data",
                    length: u64::from(header.length),
                    maximum: u64::from(OPTION_DATA_LENGTH_MAX),
                });
            }
            let mut data = vec![0u8; header.length as usize];
            self.stream
                .read_exact(&mut data)
                .map_err(|e| Error::io("read option data", e))?;
            tracing::debug!(
                option = header.code,
                length = header.length,
                "option received"
            );
            if let Some(outcome) = self.answer(header.code, &data)? {
                return Ok(outcome);
            }
        }
        Err(Error::protocol(format!(
            "more than {OPTIONS_MAX} options in one handshake"
        )))
    }

    /// Answers one option; `Some` ends negotiation.
    fn answer(&mut self, code: u32, data: &[u8]) -> Result<Option<Outcome>> {
        if self.shutting_down.load(Ordering::SeqCst) && code != option::ABORT {
            if code == option::EXPORT_NAME {
                return Err(Error::protocol("server is shutting down"));
            }
            self.reply(code, reply::ERR_SHUTDOWN, b"server is shutting down")?;
            return Ok(None);
        }
        let tls_required =
            !self.tls_started && self.tls.is_some_and(|tls| tls.mode() == TlsMode::Require);
        if tls_required && code != option::STARTTLS && code != option::ABORT {
            if code == option::EXPORT_NAME {
                return Err(Error::protocol(
                    "NBD_OPT_EXPORT_NAME without TLS, which this server requires",
                ));
            }
            self.reply(
                code,
                reply::ERR_TLS_REQD,
                b"this server requires TLS: send NBD_OPT_STARTTLS first",
            )?;
            return Ok(None);
        }
        match code {
            option::EXPORT_NAME => self.export_name(data).map(Some),
            option::ABORT => {
                // The client may hang up without reading the ACK.
                let _ = self.reply(code, reply::ACK, &[]);
                Ok(Some(Outcome::Closed))
            }
            option::LIST => {
                self.list(data)?;
                Ok(None)
            }
            option::INFO | option::GO => self.info_or_go(code, data),
            option::STRUCTURED_REPLY | option::EXTENDED_HEADERS => {
                self.reply_style(code, data)?;
                Ok(None)
            }
            option::LIST_META_CONTEXT | option::SET_META_CONTEXT => {
                self.meta_context(code, data)?;
                Ok(None)
            }
            option::STARTTLS => {
                self.start_tls(data)?;
                Ok(None)
            }
            _ => {
                self.reply(code, reply::ERR_UNSUP, b"unknown option")?;
                Ok(None)
            }
        }
    }

    /// NBD_OPT_STRUCTURED_REPLY or NBD_OPT_EXTENDED_HEADERS.
    fn reply_style(&mut self, code: u32, data: &[u8]) -> Result<()> {
        if !data.is_empty() {
            return self.reply(code, reply::ERR_INVALID, b"option takes no data");
        }
        if code == option::EXTENDED_HEADERS {
            self.extended = true;
        } else if self.extended {
            return self.reply(
                code,
                reply::ERR_EXT_HEADER_REQD,
                b"extended headers already negotiated",
            );
        } else {
            self.structured = true;
        }
        self.reply(code, reply::ACK, &[])
    }

    fn start_tls(&mut self, data: &[u8]) -> Result<()> {
        let code = option::STARTTLS;
        let Some(tls) = self.tls else {
            return self.reply(code, reply::ERR_UNSUP, b"TLS is not enabled on this server");
        };
        if !data.is_empty() {
            return self.reply(code, reply::ERR_INVALID, b"option takes no data");
        }
        if self.tls_started {
            return self.reply(code, reply::ERR_INVALID, b"TLS is already on");
        }
        self.reply(code, reply::ACK, &[])?;
        self.stream.start_tls(tls.config())?;
        self.tls_started = true;
        // Nothing agreed in plaintext carries over into TLS.
        self.structured = false;
        self.extended = false;
        self.meta_selection = None;
        Ok(())
    }

    fn reply(&mut self, option: u32, reply_type: u32, data: &[u8]) -> Result<()> {
        self.stream
            .write_all(&encode_option_reply(option, reply_type, data))
            .map_err(|e| Error::io("send option reply", e))
    }

    fn open(&self, name: &str) -> Result<std::result::Result<Arc<dyn Export>, String>> {
        Ok(match self.registry.open(name) {
            Ok(Some(export)) => Ok(export),
            Ok(None) => {
                let logged = self.unknown_exports_logged.get();
                if logged < UNKNOWN_EXPORTS_LOGGED_MAX {
                    self.unknown_exports_logged.set(logged + 1);
                    tracing::info!(export = %quoted(name), "unknown export requested");
                } else {
                    tracing::debug!(export = %quoted(name), "unknown export requested");
                }
                Err(format!("no export named {}", quoted(name)))
            }
            Err(error) => {
                tracing::warn!(export = %quoted(name), %error, "cannot open export");
                Err(format!("cannot open export {}: {error}", quoted(name)))
            }
        })
    }

    fn export_name(&mut self, data: &[u8]) -> Result<Outcome> {
        if self.extended {
            return Err(Error::protocol(
                "NBD_OPT_EXPORT_NAME after extended headers",
            ));
        }
        let name = protocol::parse_string(data)?;
        let export = match self.open(&name)? {
            Ok(export) => export,
            Err(message) => return Err(Error::protocol(message)),
        };
        let flags = self.transmission_flags(export.as_ref());
        self.stream
            .write_all(&protocol::encode_export_name_reply(
                export.size_bytes(),
                flags,
                self.no_zeroes,
            ))
            .map_err(|e| Error::io("send export name reply", e))?;
        Ok(Outcome::Transmission(self.negotiated(export, name, false)))
    }

    /// What transmission needs; `block_sizes` if the GO asked for NBD_INFO_BLOCK_SIZE.
    fn negotiated(&self, export: Arc<dyn Export>, name: String, block_sizes: bool) -> Negotiated {
        let style = if self.extended {
            ReplyStyle::Extended
        } else if self.structured {
            ReplyStyle::Structured
        } else {
            ReplyStyle::Simple
        };
        let contexts = match &self.meta_selection {
            Some((selected_for, contexts))
                if *selected_for == name && style != ReplyStyle::Simple =>
            {
                contexts.clone()
            }
            _ => Vec::new(),
        };
        Negotiated {
            export,
            style,
            contexts,
            requested_name: truncated(&name),
            block_sizes,
        }
    }

    fn list(&mut self, data: &[u8]) -> Result<()> {
        if !data.is_empty() {
            return self.reply(option::LIST, reply::ERR_INVALID, b"option takes no data");
        }
        for listing in self.registry.list() {
            let payload = protocol::encode_server_reply(&listing.name, &listing.description);
            self.reply(option::LIST, reply::SERVER, &payload)?;
        }
        self.reply(option::LIST, reply::ACK, &[])
    }

    fn info_or_go(&mut self, code: u32, data: &[u8]) -> Result<Option<Outcome>> {
        let request = match ExportRequest::parse(data) {
            Ok(request) => request,
            Err(error) => {
                self.reply(code, reply::ERR_INVALID, error.to_string().as_bytes())?;
                return Ok(None);
            }
        };
        let export = match self.open(&request.name)? {
            Ok(export) => export,
            Err(message) => {
                self.reply(code, reply::ERR_UNKNOWN, message.as_bytes())?;
                return Ok(None);
            }
        };
        let flags = self.transmission_flags(export.as_ref());
        self.reply(
            code,
            reply::INFO,
            &protocol::encode_info_export(export.size_bytes(), flags),
        )?;
        // Answer each known item once, in the order asked; the request may hold thousands.
        let mut sent = [false; 4];
        for &requested in &request.info_requests {
            match sent.get_mut(usize::from(requested)) {
                Some(done) if !*done => *done = true,
                _ => continue,
            }
            let item = match requested {
                info::NAME => protocol::encode_info_string(info::NAME, export.name()),
                info::DESCRIPTION if !export.description().is_empty() => {
                    protocol::encode_info_string(info::DESCRIPTION, export.description())
                }
                info::BLOCK_SIZE => protocol::encode_info_block_size(
                    BLOCK_SIZE_MIN,
                    preferred_block_size(export.as_ref()),
                    PAYLOAD_LENGTH_MAX,
                ),
                _ => continue,
            };
            self.reply(code, reply::INFO, &item)?;
        }
        self.reply(code, reply::ACK, &[])?;
        let block_sizes = request.info_requests.contains(&info::BLOCK_SIZE);
        if code == option::GO {
            Ok(Some(Outcome::Transmission(self.negotiated(
                export,
                request.name,
                block_sizes,
            ))))
        } else {
            Ok(None)
        }
    }

    fn meta_context(&mut self, code: u32, data: &[u8]) -> Result<()> {
        let setting = code == option::SET_META_CONTEXT;
        if setting {
            // SET replaces any earlier selection, even when it fails.
            self.meta_selection = None;
            if !self.structured && !self.extended {
                return self.reply(
                    code,
                    reply::ERR_INVALID,
                    b"structured replies not negotiated",
                );
            }
        }
        let request = match MetaContextRequest::parse(data) {
            Ok(request) => request,
            Err(error) => {
                return self.reply(code, reply::ERR_INVALID, error.to_string().as_bytes());
            }
        };
        if request.queries.len() > CONTEXT_QUERIES_MAX {
            let message = format!(
                "{} metadata context queries, at most {CONTEXT_QUERIES_MAX} allowed",
                request.queries.len()
            );
            return self.reply(code, reply::ERR_TOO_BIG, message.as_bytes());
        }
        let export = match self.open(&request.export_name)? {
            Ok(export) => export,
            Err(message) => return self.reply(code, reply::ERR_UNKNOWN, message.as_bytes()),
        };
        if !setting {
            for name in listed_contexts(export.as_ref(), self.registry, &request.queries) {
                let payload = protocol::encode_meta_context_reply(0, &name);
                self.reply(code, reply::META_CONTEXT, &payload)?;
            }
            return self.reply(code, reply::ACK, &[]);
        }
        let chosen = match selected_contexts(export.as_ref(), self.registry, &request.queries) {
            Ok(chosen) => chosen,
            Err(()) => {
                let message =
                    format!("more than {CONTEXTS_SELECTED_MAX} metadata contexts selected");
                return self.reply(code, reply::ERR_TOO_BIG, message.as_bytes());
            }
        };
        let mut contexts = Vec::with_capacity(chosen.len());
        for (name, source) in chosen {
            let id = self.next_context_id;
            self.next_context_id = self.next_context_id.wrapping_add(1).max(1);
            let payload = protocol::encode_meta_context_reply(id, &name);
            self.reply(code, reply::META_CONTEXT, &payload)?;
            contexts.push(SelectedContext { id, source });
        }
        self.meta_selection = Some((request.export_name, contexts));
        self.reply(code, reply::ACK, &[])
    }

    /// Transmission flags for `export` under the state negotiated so far.
    fn transmission_flags(&self, export: &dyn Export) -> u16 {
        let mut flags = transmission_flags::HAS_FLAGS
            | transmission_flags::SEND_FLUSH
            | transmission_flags::SEND_FUA
            | transmission_flags::SEND_CACHE;
        let capabilities = export.capabilities();
        if capabilities.read_only {
            flags |= transmission_flags::READ_ONLY;
        } else {
            flags |= transmission_flags::SEND_WRITE_ZEROES;
            if capabilities.trim {
                flags |= transmission_flags::SEND_TRIM;
            }
            if capabilities.fast_zero {
                flags |= transmission_flags::SEND_FAST_ZERO;
            }
        }
        if capabilities.multi_conn {
            flags |= transmission_flags::CAN_MULTI_CONN;
        }
        if self.structured || self.extended {
            // Every READ reply is a single data chunk, so DF always holds.
            flags |= transmission_flags::SEND_DF;
        }
        flags
    }
}

/// The export's preferred block size if it is a power of two from 512 bytes to the maximum
/// payload, else [`BLOCK_SIZE_PREFERRED`].
fn preferred_block_size(export: &dyn Export) -> u32 {
    let preferred = export.capabilities().preferred_block_size_bytes;
    if preferred.is_power_of_two() && (BLOCK_SIZE_MIN..=PAYLOAD_LENGTH_MAX).contains(&preferred) {
        preferred
    } else {
        BLOCK_SIZE_PREFERRED
    }
}

mod contexts;
use contexts::{listed_contexts, selected_contexts};

#[cfg(test)]
mod starttls_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_escapes_and_bounds_client_strings() {
        assert_eq!(quoted("disk"), "\"disk\"");
        assert_eq!(quoted("a\u{202e}b\n\"c"), "\"a\\u{202e}b\\n\\\"c\"");
        let long = "x".repeat(4096);
        let text = quoted(&long);
        assert!(text.len() < QUOTED_CHARS_MAX + 32, "{} bytes", text.len());
        assert!(text.ends_with("... (4096 bytes)"), "{text}");
        // Escapes expand a character at most to `\u{10ffff}`.
        let hostile = "\u{1b}".repeat(4096);
        assert!(quoted(&hostile).len() <= QUOTED_CHARS_MAX * 10 + 32);
        assert_eq!(truncated(&long).len(), QUOTED_CHARS_MAX);
        assert_eq!(
            truncated("é".repeat(100).as_str()).chars().count(),
            QUOTED_CHARS_MAX
        );
        assert_eq!(truncated("disk"), "disk");
    }
}
