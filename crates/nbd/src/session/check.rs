//! The checks a request passes before it may reach the export: a known command with flags
//! valid for it, no payload where none belongs, nothing written to a read-only export, a
//! range inside the export (aligned to [`BLOCK_SIZE_MIN`] for a client that agreed to the
//! block sizes), a READ no longer than [`PAYLOAD_LENGTH_MAX`], a BLOCK_STATUS with a
//! context selected and a nonzero length. A refused request is answered with the error and
//! the connection goes on.

use super::Connection;
use crate::error::{Error, ErrorKind};
use crate::handshake::ReplyStyle;
use crate::protocol::{command, command_flags, Request, BLOCK_SIZE_MIN, PAYLOAD_LENGTH_MAX};

/// What the checks decided about one request.
pub(super) enum Verdict {
    /// Serve it.
    Run,
    /// Answer at once with this error (after discarding any payload).
    Refuse(Error),
}

type Checked = std::result::Result<(), Error>;

fn refused(kind: ErrorKind, message: String) -> Checked {
    Err(Error::export(kind, message))
}

impl Connection {
    /// Checks a request before it may reach the export.
    pub(super) fn check(&self, request: &Request, payload_length: u64) -> Verdict {
        match self.checked(request, payload_length) {
            Ok(()) => Verdict::Run,
            Err(error) => Verdict::Refuse(error),
        }
    }

    fn checked(&self, request: &Request, payload_length: u64) -> Checked {
        self.check_flags(request)?;
        let command = request.command;
        if command != command::WRITE && payload_length > 0 {
            return refused(
                ErrorKind::InvalidArgument,
                format!("command {command} takes no payload"),
            );
        }
        if command == command::FLUSH {
            return Ok(());
        }
        let writes = matches!(
            command,
            command::WRITE | command::TRIM | command::WRITE_ZEROES
        );
        if writes && self.export.capabilities().read_only {
            return refused(
                ErrorKind::PermissionDenied,
                "export is read-only".to_owned(),
            );
        }
        self.check_range(request)?;
        if command == command::READ && request.length > u64::from(PAYLOAD_LENGTH_MAX) {
            return refused(
                ErrorKind::Overflow,
                format!(
                    "read length {} exceeds the maximum {PAYLOAD_LENGTH_MAX}",
                    request.length
                ),
            );
        }
        if command == command::BLOCK_STATUS {
            if self.contexts.is_empty() {
                return refused(
                    ErrorKind::InvalidArgument,
                    "no metadata context selected".to_owned(),
                );
            }
            if request.length == 0 {
                return refused(
                    ErrorKind::InvalidArgument,
                    "block status of zero length".to_owned(),
                );
            }
        }
        Ok(())
    }

    /// A known command, with only the flags valid for it.
    fn check_flags(&self, request: &Request) -> Checked {
        let command = request.command;
        let extended = self.style == ReplyStyle::Extended;
        let mut flags_allowed = command_flags::FUA;
        match command {
            command::READ => flags_allowed |= command_flags::DF,
            command::WRITE if extended => flags_allowed |= command_flags::PAYLOAD_LEN,
            command::WRITE_ZEROES => {
                flags_allowed |= command_flags::NO_HOLE;
                if self.export.capabilities().fast_zero {
                    flags_allowed |= command_flags::FAST_ZERO;
                }
            }
            command::BLOCK_STATUS => flags_allowed |= command_flags::REQ_ONE,
            command::WRITE | command::FLUSH | command::TRIM | command::CACHE => {}
            _ => {
                return refused(
                    ErrorKind::InvalidArgument,
                    format!("unknown command {command}"),
                )
            }
        }
        if request.flags & !flags_allowed != 0 {
            return refused(
                ErrorKind::InvalidArgument,
                format!("flags {:#x} not valid for command {command}", request.flags),
            );
        }
        Ok(())
    }

    /// A range inside the export, aligned unless the client may send any alignment.
    fn check_range(&self, request: &Request) -> Checked {
        let size = self.export.size_bytes();
        let inside = request
            .offset
            .checked_add(request.length)
            .is_some_and(|end| end <= size);
        if !inside {
            let kind = match request.command {
                command::WRITE | command::WRITE_ZEROES => ErrorKind::NoSpace,
                _ => ErrorKind::InvalidArgument,
            };
            return refused(
                kind,
                format!(
                    "offset {} length {} is outside the export of {size} bytes",
                    request.offset, request.length
                ),
            );
        }
        let block = u64::from(BLOCK_SIZE_MIN);
        let aligned = request.offset.is_multiple_of(block) && request.length.is_multiple_of(block);
        if !aligned && !self.any_alignment {
            return refused(
                ErrorKind::InvalidArgument,
                format!(
                    "offset {} length {} not aligned to {block} bytes",
                    request.offset, request.length
                ),
            );
        }
        Ok(())
    }
}
