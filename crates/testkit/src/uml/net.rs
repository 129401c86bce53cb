//! A network between two UML kernels that never leaves the machine: UML's `ucast` transport
//! (built into Debian's kernel, `CONFIG_UML_NET_MCAST`) carries each guest's Ethernet frames
//! as UDP datagrams between two ports on the host's `127.0.0.1`, so no tap device, bridge,
//! namespace or privilege is needed, and a killed guest simply stops answering (no reset
//! reaches its peer, as when a machine loses power).
//!
//! [`UcastLink::new`] picks two free UDP ports; [`Boot::ethernet`] gives one end to a boot
//! (`eth0=ucast,MAC,127.0.0.1,LISTEN_PORT,PEER_PORT` on the kernel command line), and
//! [`LinkEnd::guest_setup`] is the shell that gives the guest's `eth0` its address.

use super::Boot;
use std::collections::BTreeSet;
use std::net::{Ipv4Addr, UdpSocket};
use std::sync::Mutex;

/// The guests' subnet (a /24; each end's address is `10.99.N.1` or `.2`).
const SUBNET: [u8; 3] = [10, 99, 0];

/// A point-to-point Ethernet link between two guests over two loopback UDP ports.
#[derive(Clone, Debug)]
pub struct UcastLink {
    ports: [u16; 2],
}

/// One end of a [`UcastLink`]: which guest (0 or 1) and the link.
#[derive(Clone, Debug)]
pub struct LinkEnd {
    link: UcastLink,
    side: usize,
}

impl UcastLink {
    /// A link on two UDP ports of `127.0.0.1` that were free a moment ago (bound to port 0,
    /// then released: the kernel binds them again when it boots) and that this process has
    /// not handed out before.
    pub fn new() -> UcastLink {
        // Ports this process handed out already: never twice, even after their release.
        static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut held = Vec::new();
        let mut ports = Vec::new();
        while ports.len() < 2 {
            let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
                .unwrap_or_else(|e| panic!("cannot bind a UDP port on 127.0.0.1: {e}"));
            let port = socket
                .local_addr()
                .expect("bound socket has an address")
                .port();
            if given.insert(port) {
                ports.push(port);
            }
            // Held until both are chosen, so the two differ.
            held.push(socket);
        }
        UcastLink {
            ports: [ports[0], ports[1]],
        }
    }

    /// Guest `side`'s end (0 or 1).
    pub fn end(&self, side: usize) -> LinkEnd {
        assert!(side < 2, "a link has two ends, not {side}");
        LinkEnd {
            link: self.clone(),
            side,
        }
    }
}

impl Default for UcastLink {
    fn default() -> UcastLink {
        UcastLink::new()
    }
}

impl LinkEnd {
    /// This guest's IPv4 address on the link.
    pub fn address(&self) -> Ipv4Addr {
        Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], 1 + self.side as u8)
    }

    /// The other guest's address.
    pub fn peer_address(&self) -> Ipv4Addr {
        self.link.end(1 - self.side).address()
    }

    /// The kernel argument that makes this end the guest's `eth0`: a fixed, distinct,
    /// locally administered MAC, then `127.0.0.1`, the port it listens on and its peer's.
    pub fn kernel_arg(&self) -> String {
        format!(
            "eth0=ucast,52:54:00:99:00:{:02x},127.0.0.1,{},{}",
            self.side + 1,
            self.link.ports[self.side],
            self.link.ports[1 - self.side]
        )
    }

    /// Shell lines for the guest script: loopback and `eth0` up, `eth0` at [`address`]/24.
    ///
    /// [`address`]: LinkEnd::address
    pub fn guest_setup(&self) -> String {
        format!(
            "ip link set lo up\nip addr add {}/24 dev eth0\nip link set eth0 up\n",
            self.address()
        )
    }
}

impl Boot {
    /// Gives the guest `end` of a link as its `eth0` (configure it with
    /// [`LinkEnd::guest_setup`]).
    pub fn ethernet(mut self, end: &LinkEnd) -> Boot {
        self.kernel_args.push(end.kernel_arg());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_ends_listen_where_the_other_sends() {
        let link = UcastLink::new();
        let (a, b) = (link.end(0), link.end(1));
        let fields = |end: &LinkEnd| {
            end.kernel_arg()
                .split(',')
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let (fa, fb) = (fields(&a), fields(&b));
        assert_eq!(fa[0], "eth0=ucast");
        assert_ne!(fa[1], fb[1], "distinct MACs");
        assert_eq!(fa[3], fb[4]);
        assert_eq!(fa[4], fb[3]);
        assert_eq!(a.peer_address(), b.address());
        assert_eq!(b.peer_address(), a.address());
        assert!(a.guest_setup().contains("10.99.0.1/24 dev eth0"));
    }
}
