//! Moves a file range straight between guest memory and the file: `preadv` (a read) or
//! `pwritev` (a write) with the host addresses of the guest buffers (up to [`IOVECS_MAX`] at
//! once), so the bytes pass no buffer of ours. The one module of this crate with `unsafe`
//! (the two calls; every other access to guest memory goes through vm-memory's checked,
//! volatile accessors).
//!
//! Why it is sound: every guest range is turned into host addresses by vm-memory
//! (`get_slices`, which checks it lies inside a mapped region of the memory table), and the
//! [`GuestReader`] borrows the memory snapshot those regions belong to, so they stay mapped
//! (the snapshot keeps the old mappings alive across a SET_MEM_TABLE) until the last
//! call has returned. The kernel reads or writes those bytes as a device's DMA would:
//! nothing in this process holds a Rust reference into guest memory (vm-memory hands out only
//! volatile slices), so no reference is aliased; the guest may change the bytes at any time
//! (a write then stores some mix of old and new, as a disk would), which is its own business. Regions are mapped without a dirty bitmap here (`Bitmap = ()`: no
//! dirty-page logging is offered), so there is nothing to mark.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Most guest buffers one `preadv` fills.
pub const IOVECS_MAX: usize = 64;

/// Which way the bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// File to guest memory (`preadv`): a read request.
    FromFile,
    /// Guest memory to file (`pwritev`): a write request.
    ToFile,
}

/// Gathers guest buffers and moves them to or from consecutive bytes of a file.
pub struct GuestIo<'a> {
    direction: Direction,
    mem: &'a GuestMemoryMmap,
    file: &'a File,
    /// File offset of the first byte of the gathered buffers.
    offset: u64,
    iovecs: [libc::iovec; IOVECS_MAX],
    count: usize,
}

impl<'a> GuestIo<'a> {
    /// A transfer between guest memory `mem` and `file` from `offset`.
    pub fn new(
        direction: Direction,
        mem: &'a GuestMemoryMmap,
        file: &'a File,
        offset: u64,
    ) -> Self {
        GuestIo {
            direction,
            mem,
            file,
            offset,
            iovecs: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; IOVECS_MAX],
            count: 0,
        }
    }

    /// Adds the `len` guest bytes at `addr` as the next bytes to move (moved when the batch
    /// is full, or at [`GuestIo::finish`]). Fails if they are not all inside `mem`.
    pub fn add(&mut self, addr: GuestAddress, len: usize) -> io::Result<()> {
        for slice in self.mem.get_slices(addr, len) {
            let slice = slice.map_err(|e| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("guest memory: {e}"))
            })?;
            if self.count == IOVECS_MAX {
                self.transfer()?;
            }
            let base = match self.direction {
                Direction::FromFile => slice.ptr_guard_mut().as_ptr(),
                Direction::ToFile => slice.ptr_guard().as_ptr().cast_mut(),
            };
            self.iovecs[self.count] = libc::iovec {
                iov_base: base.cast(),
                iov_len: slice.len(),
            };
            self.count += 1;
        }
        Ok(())
    }

    /// Moves every buffer added and not yet moved.
    pub fn finish(mut self) -> io::Result<()> {
        self.transfer()
    }

    /// Moves the gathered buffers, call after call until all are done; a file that ends
    /// first (a read) or takes nothing (a write) is an error.
    fn transfer(&mut self) -> io::Result<()> {
        let mut first = 0;
        while first < self.count {
            let offset = libc::off_t::try_from(self.offset).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, "file offset past off_t")
            })?;
            let count = (self.count - first) as libc::c_int;
            let fd = self.file.as_raw_fd();
            let iovecs = self.iovecs[first..].as_ptr();
            let done = match self.direction {
                // SAFETY: `iovecs[first..first + count]` are initialized iovecs, each the host
                // address and length of a volatile slice that vm-memory checked lies inside a
                // region of `self.mem`, whose mappings live at least as long as the borrow
                // `self` holds (see the module docs); the regions are mapped writable. The
                // kernel only writes through them; no Rust reference points into guest memory.
                Direction::FromFile => unsafe { libc::preadv(fd, iovecs, count, offset) },
                // SAFETY: as above; the kernel only reads through them.
                Direction::ToFile => unsafe { libc::pwritev(fd, iovecs, count, offset) },
            };
            let mut done = match usize::try_from(done) {
                Ok(0) if self.direction == Direction::FromFile => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("file ended at {}", self.offset),
                    ))
                }
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!("the file took no bytes at {}", self.offset),
                    ))
                }
                Ok(done) => done,
                Err(_) => {
                    let error = io::Error::last_os_error();
                    if error.kind() == io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(error);
                }
            };
            self.offset += done as u64;
            // Skip what was filled; a partly filled buffer goes on from where it stopped.
            while done > 0 {
                let iovec = &mut self.iovecs[first];
                if done >= iovec.iov_len {
                    done -= iovec.iov_len;
                    first += 1;
                } else {
                    iovec.iov_base = iovec.iov_base.cast::<u8>().wrapping_add(done).cast();
                    iovec.iov_len -= done;
                    done = 0;
                }
            }
        }
        self.count = 0;
        Ok(())
    }
}
