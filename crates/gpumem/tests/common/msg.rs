//! The ring-bridge message of the tests and the example: 128 bytes, cache-line aligned, with a
//! checksum, and the CUDA kernel that echoes such messages from one ring to the other.
//! Included with `#[path]` by tests/transfer.rs, tests/gpu_transfer.rs and
//! examples/ring_bridge.rs.

use bytemuck::{Pod, Zeroable};

/// A cache-line message, as in the ring-bridge design.
#[repr(C, align(128))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct Msg {
    pub seq: u64,
    pub check: u64,
    pub payload: [u32; 28],
}

impl Msg {
    /// Message number `seq`, with a payload derived from it and its checksum.
    pub fn new(seq: u64) -> Self {
        let mut payload = [0u32; 28];
        for (i, p) in payload.iter_mut().enumerate() {
            *p = (seq as u32).wrapping_mul(2654435761).wrapping_add(i as u32);
        }
        Msg {
            seq,
            check: Self::sum(seq, &payload),
            payload,
        }
    }

    fn sum(seq: u64, payload: &[u32; 28]) -> u64 {
        payload
            .iter()
            .fold(seq, |a, &p| a.rotate_left(5) ^ p as u64)
    }

    /// True if the checksum matches the contents.
    pub fn intact(&self) -> bool {
        self.check == Self::sum(self.seq, &self.payload)
    }
}

/// CUDA source of `echo`: copy `n` messages from the outbox ring (from seq `in0`) to the inbox
/// ring (from seq `out0`), both of `cap` slots. Unused by the host-only tests.
#[allow(dead_code)]
pub const ECHO_KERNEL: &str = r#"
struct __align__(128) Msg { unsigned long long seq, check; unsigned int payload[28]; };
extern "C" __global__ void echo(Msg* inbox, const Msg* outbox, unsigned long long cap,
                                unsigned long long in0, unsigned long long out0,
                                unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) inbox[(out0 + i) % cap] = outbox[(in0 + i) % cap];
}
"#;

/// Drive a polled ring whose device echoes: `rounds` bursts of `burst(round)` messages, each
/// burst's replies received in order and checked (when the return ring would overflow, the
/// replies so far are taken first). Returns the messages sent, all received.
#[allow(dead_code)]
pub fn echo_bursts(
    ring: &mut gpumem::buffer::ring::RingBridge<Msg>,
    rounds: u64,
    burst: impl Fn(u64) -> u64,
) -> u64 {
    let cap = ring.capacity() as u64;
    let (mut sent, mut got) = (0u64, 0u64);
    let take = |ring: &mut gpumem::buffer::ring::RingBridge<Msg>, got: &mut u64| {
        for m in ring.receive_at_least(1).unwrap() {
            assert!(m.intact(), "message {got} corrupted");
            assert_eq!(m, Msg::new(*got), "message {got} out of order");
            *got += 1;
        }
    };
    for round in 0..rounds {
        for _ in 0..burst(round) {
            if sent - got == cap {
                // replies fill the return ring: take them before sending more
                take(ring, &mut got);
            }
            ring.send(Msg::new(sent)).unwrap();
            sent += 1;
        }
        while got < sent {
            take(ring, &mut got);
        }
    }
    sent
}
