//! A real DNS server for the discovery tests: UDP on a free loopback port, answering A and
//! AAAA queries from a zone the test edits while the daemon runs (names added, changed,
//! removed), or failing every query (SERVFAIL) on demand. The wire format is written here from
//! RFC 1035 and RFC 3596, independently of the resolver the daemon uses.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const A: u16 = 1;
const AAAA: u16 = 28;
const NOERROR: u8 = 0;
const SERVFAIL: u8 = 2;
const NXDOMAIN: u8 = 3;

#[derive(Default)]
struct State {
    zone: Mutex<HashMap<String, Vec<IpAddr>>>,
    failing: AtomicBool,
    queries: AtomicU64,
    stop: AtomicBool,
}

/// The running server; stops when dropped.
pub struct DnsServer {
    /// Where it listens (give it as `discovery.nameservers`).
    pub addr: SocketAddr,
    state: Arc<State>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DnsServer {
    /// Starts a server on `127.0.0.1` with an empty zone.
    pub fn start() -> Self {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind a UDP port");
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("read timeout");
        let addr = socket.local_addr().expect("local addr");
        let state = Arc::new(State::default());
        let serving = state.clone();
        let thread = std::thread::spawn(move || serve(socket, &serving));
        Self {
            addr,
            state,
            thread: Some(thread),
        }
    }

    /// `name` now has these addresses (an empty list: the name exists with no address).
    pub fn set(&self, name: &str, addresses: &[IpAddr]) {
        self.state
            .zone
            .lock()
            .expect("zone")
            .insert(name.to_ascii_lowercase(), addresses.to_vec());
    }

    /// `name` no longer exists (NXDOMAIN).
    pub fn remove(&self, name: &str) {
        self.state
            .zone
            .lock()
            .expect("zone")
            .remove(&name.to_ascii_lowercase());
    }

    /// While on, every query is answered SERVFAIL.
    pub fn fail(&self, on: bool) {
        self.state.failing.store(on, Ordering::SeqCst);
    }

    /// Queries answered so far.
    pub fn queries(&self) -> u64 {
        self.state.queries.load(Ordering::SeqCst)
    }
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(socket: UdpSocket, state: &State) {
    let mut buf = [0u8; 4096];
    while !state.stop.load(Ordering::SeqCst) {
        let Ok((n, peer)) = socket.recv_from(&mut buf) else {
            continue;
        };
        if let Some(reply) = answer(&buf[..n], state) {
            state.queries.fetch_add(1, Ordering::SeqCst);
            let _ = socket.send_to(&reply, peer);
        }
    }
}

/// The reply to one query: the header and question echoed, then the answers.
fn answer(query: &[u8], state: &State) -> Option<Vec<u8>> {
    if query.len() < 12 || u16::from_be_bytes([query[4], query[5]]) != 1 {
        return None;
    }
    // The question: labels up to the root, then QTYPE and QCLASS.
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = *query.get(at)? as usize;
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(query.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = u16::from_be_bytes([*query.get(at)?, *query.get(at + 1)?]);
    let question_end = at + 4;
    let question = query.get(12..question_end)?;
    let name = labels.join(".");

    let (rcode, addresses) = if state.failing.load(Ordering::SeqCst) {
        (SERVFAIL, Vec::new())
    } else {
        match state.zone.lock().expect("zone").get(&name) {
            None => (NXDOMAIN, Vec::new()),
            Some(all) => (
                NOERROR,
                all.iter()
                    .filter(|ip| matches!((qtype, ip), (A, IpAddr::V4(_)) | (AAAA, IpAddr::V6(_))))
                    .copied()
                    .collect(),
            ),
        }
    };
    let mut reply = Vec::with_capacity(512);
    reply.extend_from_slice(&query[..2]); // id
    let rd = query[2] & 0x01;
    let opcode = query[2] & 0x78;
    reply.push(0x80 | opcode | 0x04 | rd); // QR, opcode, AA, RD
    reply.push(0x80 | rcode); // RA, RCODE
    reply.extend_from_slice(&1u16.to_be_bytes()); // QDCOUNT
    reply.extend_from_slice(&(addresses.len() as u16).to_be_bytes()); // ANCOUNT
    reply.extend_from_slice(&[0, 0, 0, 0]); // NSCOUNT, ARCOUNT
    reply.extend_from_slice(question);
    for ip in addresses {
        reply.extend_from_slice(&[0xC0, 12]); // the question's name
        let (rtype, data) = match ip {
            IpAddr::V4(v4) => (A, v4.octets().to_vec()),
            IpAddr::V6(v6) => (AAAA, v6.octets().to_vec()),
        };
        reply.extend_from_slice(&rtype.to_be_bytes());
        reply.extend_from_slice(&1u16.to_be_bytes()); // IN
        reply.extend_from_slice(&5u32.to_be_bytes()); // TTL, as CoreDNS gives headless names
        reply.extend_from_slice(&(data.len() as u16).to_be_bytes());
        reply.extend_from_slice(&data);
    }
    Some(reply)
}
