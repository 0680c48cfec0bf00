//! Peer copies between devices, and the start-up self-test that decides, pair by pair, whether
//! they are trusted.
//!
//! Some multi-GPU setups corrupt peer-to-peer copies (a report of two RX 9070 XT, gfx1201, that
//! only worked with peer copies compiled out of llama.cpp). Instead of a compile-time switch,
//! the engine copies known patterns of several sizes and alignments both ways between every
//! pair of devices at start, compares checksums, and keeps peer copies only for the pairs that
//! pass; the others go through host staging, with the reason kept for `ember devices` and the
//! log. The test never aborts: a failing or erroring copy only turns that pair's peer copies
//! off.
//!
//! [`SimPeerLink`] is the peer path of simulated devices (`--device sim:0,sim:1`): a copy
//! through a staging buffer that can be told to corrupt one direction of a pair
//! (`EMBER_SIM_CORRUPT_PEER=0,1` corrupts copies from device 0 to device 1), so the self-test
//! and the fallback can be exercised on a machine without GPUs.
//!
//! [`DriverPeerLink`] is the peer path of real GPUs: a pattern is uploaded to a buffer on the
//! source device, copied by the driver's peer copy to a buffer on the destination, and
//! downloaded there, so the self-test checks the very copy the split then uses.

use std::fmt;
use std::sync::Arc;

use crate::driver::{DeviceOrdinal, Driver, DriverError, StreamHandle};

/// The `peer_copy` gate of a build target (`targets.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerGate {
    /// Peer copies are used between every pair that supports them.
    On,
    /// Peer copies are never used: every copy goes through host memory.
    Off,
    /// Peer copies are used only for the pairs whose start-up self-test passes.
    Probe,
}

impl fmt::Display for PeerGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PeerGate::On => "on",
            PeerGate::Off => "off",
            PeerGate::Probe => "probe",
        })
    }
}

/// A way to copy bytes from one device to another without host staging.
pub trait PeerLink: Send + Sync {
    /// Copies `data` from device `src` to device `dst` and hands back what arrived there
    /// (replacing the contents of `out`).
    fn copy(&self, src: usize, dst: usize, data: &[u8], out: &mut Vec<u8>) -> Result<(), String>;
}

/// The start-up self-test's verdict on a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelfTest {
    /// Not run: the gate decided alone, or there is no peer path to test.
    NotRun,
    /// Every pattern arrived intact, both ways.
    Passed,
    /// A copy failed or arrived changed (the reason says which).
    Failed,
}

impl fmt::Display for SelfTest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SelfTest::NotRun => "not run",
            SelfTest::Passed => "passed",
            SelfTest::Failed => "failed",
        })
    }
}

/// How copies from one device to another travel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairState {
    pub src: usize,
    pub dst: usize,
    /// Whether peer copies are used; when not, `reason` says why.
    pub peer: bool,
    pub reason: String,
    pub self_test: SelfTest,
}

impl fmt::Display for PairState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.peer {
            write!(f, "{} -> {}: peer ({})", self.src, self.dst, self.reason)
        } else {
            write!(
                f,
                "{} -> {}: host staging ({})",
                self.src, self.dst, self.reason
            )
        }
    }
}

/// Sizes of the test patterns, in bytes: one byte, odd sizes that end mid-word, and sizes
/// around the driver's usual copy-engine thresholds.
pub const PATTERN_SIZES: [usize; 6] = [1, 7, 256, 4099, 65_536 + 13, 1 << 20];
/// Start offsets of the patterns inside their buffer, to catch copies that mishandle
/// misaligned ends.
pub const PATTERN_OFFSETS: [usize; 3] = [0, 1, 61];

/// A byte pattern that differs for every size, offset and direction, so a copy that returns
/// a stale or swapped buffer fails too.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// FNV-1a over the bytes.
pub fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Copies every pattern from `src` to `dst` over `link`; the first mismatch or error, if any.
pub fn test_direction(link: &dyn PeerLink, src: usize, dst: usize) -> Result<(), String> {
    let mut out = Vec::new();
    for (si, &size) in PATTERN_SIZES.iter().enumerate() {
        for (oi, &offset) in PATTERN_OFFSETS.iter().enumerate() {
            let seed = ((src * 64 + dst) * 64 + si * 8 + oi) as u64 + 1;
            let buffer = pattern(offset + size, seed);
            let data = &buffer[offset..];
            link.copy(src, dst, data, &mut out)
                .map_err(|e| format!("a copy of {size} bytes at offset {offset} failed: {e}"))?;
            if out.len() != data.len() || checksum(&out) != checksum(data) {
                return Err(format!(
                    "a copy of {size} bytes at offset {offset} arrived changed (checksum {:016x}, expected {:016x})",
                    checksum(&out),
                    checksum(data)
                ));
            }
        }
    }
    Ok(())
}

/// Decides how copies travel between every ordered pair of `n_devices` devices: with the
/// gate `Off` or without a link, host staging; `On`, peer copies; `Probe`, peer copies where
/// both directions of the pair pass [`test_direction`], host staging with the failure as the
/// reason elsewhere.
pub fn plan_pairs(n_devices: usize, gate: PeerGate, link: Option<&dyn PeerLink>) -> Vec<PairState> {
    let mut pairs = Vec::new();
    for src in 0..n_devices {
        for dst in 0..n_devices {
            if src == dst {
                continue;
            }
            let (peer, reason, self_test) = match (gate, link) {
                (PeerGate::Off, _) => (
                    false,
                    "the peer_copy gate is off for this target".into(),
                    SelfTest::NotRun,
                ),
                (_, None) => (
                    false,
                    "these devices have no peer copy path".into(),
                    SelfTest::NotRun,
                ),
                (PeerGate::On, Some(_)) => {
                    (true, "the peer_copy gate is on".into(), SelfTest::NotRun)
                }
                (PeerGate::Probe, Some(link)) => {
                    match test_direction(link, src, dst)
                        .and_then(|()| test_direction(link, dst, src))
                    {
                        Ok(()) => (true, "self-test passed both ways".into(), SelfTest::Passed),
                        Err(failure) => (
                            false,
                            format!("self-test failed: {failure}"),
                            SelfTest::Failed,
                        ),
                    }
                }
            };
            pairs.push(PairState {
                src,
                dst,
                peer,
                reason,
                self_test,
            });
        }
    }
    pairs
}

/// The peer path of simulated devices: the bytes go through a staging copy, and the pairs
/// named by [`SimPeerLink::corrupting`] flip a bit of every copy in that direction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SimPeerLink {
    corrupt: Vec<(usize, usize)>,
}

/// The environment variable naming the simulated pairs whose peer copies corrupt.
pub const CORRUPT_PEER_ENV: &str = "EMBER_SIM_CORRUPT_PEER";

impl SimPeerLink {
    /// A link whose copies from `src` to `dst` corrupt, for each pair given.
    pub fn corrupting(pairs: Vec<(usize, usize)>) -> SimPeerLink {
        SimPeerLink { corrupt: pairs }
    }

    /// The pairs whose copies corrupt.
    pub fn corrupt_pairs(&self) -> &[(usize, usize)] {
        &self.corrupt
    }

    /// A link configured from [`CORRUPT_PEER_ENV`] (`SRC,DST`, several pairs separated by
    /// `;`); unset or empty means no corruption.
    pub fn from_env() -> Result<SimPeerLink, String> {
        match std::env::var(CORRUPT_PEER_ENV) {
            Ok(text) => Self::parse(&text),
            Err(_) => Ok(SimPeerLink::default()),
        }
    }

    /// Parses `SRC,DST[;SRC,DST...]`.
    pub fn parse(text: &str) -> Result<SimPeerLink, String> {
        let mut corrupt = Vec::new();
        for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let pair = part
                .split_once(',')
                .and_then(|(a, b)| Some((a.trim().parse().ok()?, b.trim().parse().ok()?)));
            match pair {
                Some((src, dst)) if src != dst => corrupt.push((src, dst)),
                _ => {
                    return Err(format!(
                        "{CORRUPT_PEER_ENV}: expected SRC,DST device pairs such as 0,1 (two different devices), found {text:?}"
                    ))
                }
            }
        }
        Ok(SimPeerLink { corrupt })
    }
}

impl PeerLink for SimPeerLink {
    fn copy(&self, src: usize, dst: usize, data: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        out.clear();
        out.extend_from_slice(data);
        if self.corrupt.contains(&(src, dst)) {
            corrupt(out);
        }
        Ok(())
    }
}

/// What a simulated broken peer copy does to the bytes it carries ([`SimPeerLink`], and the
/// host driver's peer copies told to corrupt): a high bit of every 97th 4-byte word flipped (of
/// the one byte when shorter). In f32 data that is an exponent bit, so the damage is large, as a
/// broken copy engine's is, and reaches the first value of every buffer.
pub fn corrupt(bytes: &mut [u8]) {
    if bytes.len() < 4 {
        if let Some(byte) = bytes.first_mut() {
            *byte ^= 0x40;
        }
    }
    for index in (3..bytes.len()).step_by(4 * 97) {
        bytes[index] ^= 0x40;
    }
}

/// The peer path of GPUs: device `i` of the link is `devices[i]` (a driver and its ordinal;
/// one ordinal may appear twice, two backends on one GPU, where the copy is a device-to-device
/// one).
#[derive(Debug, Clone)]
pub struct DriverPeerLink {
    devices: Vec<(Arc<dyn Driver>, DeviceOrdinal)>,
}

impl DriverPeerLink {
    pub fn new(devices: Vec<(Arc<dyn Driver>, DeviceOrdinal)>) -> DriverPeerLink {
        DriverPeerLink { devices }
    }

    /// Lets device `dst` read device `src`'s memory: `Err` says why it cannot (no peer access
    /// between them, or the driver refused to enable it).
    pub fn enable(&self, src: usize, dst: usize) -> Result<(), String> {
        let (src_driver, src_ordinal) = self.device(src)?;
        let (dst_driver, dst_ordinal) = self.device(dst)?;
        if src_driver.backend() != dst_driver.backend() {
            return Err(format!(
                "a {} device and a {} device have no peer path",
                src_driver.backend(),
                dst_driver.backend()
            ));
        }
        let can = dst_driver
            .can_access_peer(dst_ordinal, src_ordinal)
            .map_err(|e| {
                format!("cannot ask whether device {dst_ordinal} reaches device {src_ordinal}: {e}")
            })?;
        if !can {
            return Err(format!(
                "device {dst_ordinal} cannot access the memory of device {src_ordinal} (no peer access between them)"
            ));
        }
        dst_driver
            .enable_peer_access(dst_ordinal, src_ordinal)
            .map_err(|e| format!("cannot enable peer access from device {dst_ordinal} to device {src_ordinal}: {e}"))
    }

    /// Enables peer access for the pairs trusted without a self-test (the `peer_copy` gate
    /// `on`; the self-test enables the pairs it tests): a pair whose devices cannot reach each
    /// other turns to host staging, with the reason.
    pub fn enable_trusted(&self, pairs: &mut [PairState]) {
        for pair in pairs
            .iter_mut()
            .filter(|p| p.peer && p.self_test == SelfTest::NotRun)
        {
            if let Err(reason) = self.enable(pair.src, pair.dst) {
                pair.peer = false;
                pair.reason = format!("the peer_copy gate is on, but {reason}");
            }
        }
    }

    fn device(&self, index: usize) -> Result<(&Arc<dyn Driver>, DeviceOrdinal), String> {
        self.devices
            .get(index)
            .map(|(driver, ordinal)| (driver, *ordinal))
            .ok_or_else(|| {
                format!(
                    "device {index} is not one of the link's {} devices",
                    self.devices.len()
                )
            })
    }

    /// Upload to `src`, peer copy to `dst`, download from `dst`; every buffer and stream made
    /// here is given back whatever happens.
    fn copy_through(
        &self,
        src: usize,
        dst: usize,
        data: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), DriverError> {
        let (src_driver, src_ordinal) = (&self.devices[src].0, self.devices[src].1);
        let (dst_driver, dst_ordinal) = (&self.devices[dst].0, self.devices[dst].1);
        let bytes = data.len().max(1) as u64;
        let src_stream = Scoped::stream(src_driver, src_ordinal)?;
        let dst_stream = Scoped::stream(dst_driver, dst_ordinal)?;
        let src_buf = Scoped::alloc(src_driver, src_ordinal, bytes)?;
        let dst_buf = Scoped::alloc(dst_driver, dst_ordinal, bytes)?;
        src_driver.upload(
            src_ordinal,
            crate::DevicePtr(src_buf.handle),
            data,
            StreamHandle(src_stream.handle),
        )?;
        dst_driver.copy_peer_async(
            dst_ordinal,
            crate::DevicePtr(dst_buf.handle),
            src_ordinal,
            crate::DevicePtr(src_buf.handle),
            data.len() as u64,
            StreamHandle(dst_stream.handle),
        )?;
        dst_driver.stream_synchronize(dst_ordinal, StreamHandle(dst_stream.handle))?;
        out.clear();
        out.resize(data.len(), 0);
        dst_driver.download(
            dst_ordinal,
            out,
            crate::DevicePtr(dst_buf.handle),
            StreamHandle(dst_stream.handle),
        )
    }
}

/// A stream or an allocation of the self-test, destroyed or freed when dropped.
struct Scoped<'a> {
    driver: &'a Arc<dyn Driver>,
    ordinal: DeviceOrdinal,
    handle: u64,
    stream: bool,
}

impl<'a> Scoped<'a> {
    fn stream(driver: &'a Arc<dyn Driver>, ordinal: DeviceOrdinal) -> Result<Self, DriverError> {
        let stream = driver.stream_create(ordinal)?;
        Ok(Scoped {
            driver,
            ordinal,
            handle: stream.0,
            stream: true,
        })
    }

    fn alloc(
        driver: &'a Arc<dyn Driver>,
        ordinal: DeviceOrdinal,
        bytes: u64,
    ) -> Result<Self, DriverError> {
        let ptr = driver.alloc(ordinal, bytes)?;
        Ok(Scoped {
            driver,
            ordinal,
            handle: ptr.0,
            stream: false,
        })
    }
}

impl Drop for Scoped<'_> {
    fn drop(&mut self) {
        // A failure to give back a test buffer or stream leaks it; the test's verdict stands.
        let result = if self.stream {
            self.driver
                .stream_destroy(self.ordinal, StreamHandle(self.handle))
        } else {
            self.driver
                .free(self.ordinal, crate::DevicePtr(self.handle))
        };
        if let Err(error) = result {
            tracing::warn!(%error, "the peer-copy self-test could not give back a buffer or stream");
        }
    }
}

impl PeerLink for DriverPeerLink {
    fn copy(&self, src: usize, dst: usize, data: &[u8], out: &mut Vec<u8>) -> Result<(), String> {
        self.enable(src, dst)?;
        self.copy_through(src, dst, data, out)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link whose copies from `src` to `dst` fail with an error.
    struct Failing(usize, usize);

    impl PeerLink for Failing {
        fn copy(
            &self,
            src: usize,
            dst: usize,
            data: &[u8],
            out: &mut Vec<u8>,
        ) -> Result<(), String> {
            if (src, dst) == (self.0, self.1) {
                return Err("peer access not enabled".into());
            }
            out.clear();
            out.extend_from_slice(data);
            Ok(())
        }
    }

    fn peers(pairs: &[PairState]) -> Vec<(usize, usize, bool)> {
        pairs.iter().map(|p| (p.src, p.dst, p.peer)).collect()
    }

    #[test]
    fn a_clean_link_passes_every_pair_both_ways() {
        let link = SimPeerLink::default();
        let pairs = plan_pairs(3, PeerGate::Probe, Some(&link));
        assert_eq!(pairs.len(), 6);
        assert!(pairs.iter().all(|p| p.peer
            && p.reason == "self-test passed both ways"
            && p.self_test == SelfTest::Passed));
    }

    #[test]
    fn a_corrupting_direction_turns_off_that_pair_only() {
        let link = SimPeerLink::corrupting(vec![(0, 1)]);
        let pairs = plan_pairs(3, PeerGate::Probe, Some(&link));
        assert_eq!(
            peers(&pairs),
            [
                (0, 1, false),
                (0, 2, true),
                (1, 0, false),
                (1, 2, true),
                (2, 0, true),
                (2, 1, true)
            ]
        );
        // The 1-byte pattern has its only byte changed: the first copy tested is caught.
        assert!(
            pairs[0]
                .reason
                .starts_with("self-test failed: a copy of 1 bytes at offset 0 arrived changed"),
            "{}",
            pairs[0]
        );
        assert_eq!(pairs[0].self_test, SelfTest::Failed);
        assert_eq!(pairs[1].self_test, SelfTest::Passed);
        assert!(pairs[0]
            .to_string()
            .starts_with("0 -> 1: host staging (self-test failed"));
    }

    #[test]
    fn an_erroring_copy_is_a_failed_pair_not_an_abort() {
        let pairs = plan_pairs(2, PeerGate::Probe, Some(&Failing(1, 0)));
        assert_eq!(peers(&pairs), [(0, 1, false), (1, 0, false)]);
        assert_eq!(
            pairs[1].reason,
            "self-test failed: a copy of 1 bytes at offset 0 failed: peer access not enabled"
        );
    }

    #[test]
    fn the_gate_decides_without_a_test_when_on_or_off() {
        let link = SimPeerLink::corrupting(vec![(0, 1)]);
        assert!(plan_pairs(2, PeerGate::On, Some(&link))
            .iter()
            .all(|p| p.peer && p.self_test == SelfTest::NotRun));
        let off = plan_pairs(2, PeerGate::Off, Some(&link));
        assert!(off
            .iter()
            .all(|p| !p.peer && p.reason.contains("gate is off")));
        let none = plan_pairs(2, PeerGate::Probe, None);
        assert!(none
            .iter()
            .all(|p| !p.peer && p.reason.contains("no peer copy path")));
    }

    #[test]
    fn every_pattern_size_and_offset_catches_a_flipped_bit() {
        // Checksums differ for a one-bit change at any position of any pattern.
        for (si, &size) in PATTERN_SIZES.iter().enumerate() {
            let data = pattern(size, si as u64 + 1);
            for position in [0, size / 2, size - 1] {
                let mut changed = data.clone();
                changed[position] ^= 0x01;
                assert_ne!(
                    checksum(&changed),
                    checksum(&data),
                    "size {size} at {position}"
                );
            }
        }
    }

    /// `n` connected host devices; copies into device `dst` from `src` corrupt for each pair of
    /// `corrupt`.
    #[cfg(unix)]
    fn host_gpus(n: usize, corrupt: &[(usize, usize)]) -> Vec<Arc<crate::host::HostDriver>> {
        use crate::host::{HostDriver, HostDriverConfig};
        let drivers: Vec<Arc<HostDriver>> = (0..n)
            .map(|ordinal| {
                Arc::new(HostDriver::new(HostDriverConfig {
                    ordinal,
                    corrupt_peer_from: corrupt
                        .iter()
                        .filter(|&&(_, dst)| dst == ordinal)
                        .map(|&(src, _)| src)
                        .collect(),
                    ..HostDriverConfig::default()
                }))
            })
            .collect();
        HostDriver::connect_peers(&drivers);
        drivers
    }

    #[cfg(unix)]
    fn link_over(drivers: &[Arc<crate::host::HostDriver>]) -> DriverPeerLink {
        DriverPeerLink::new(
            drivers
                .iter()
                .map(|d| (Arc::clone(d) as Arc<dyn Driver>, d.config().ordinal))
                .collect(),
        )
    }

    #[cfg(unix)]
    #[test]
    fn the_driver_link_self_tests_real_peer_copies_and_catches_a_corrupting_direction() {
        let drivers = host_gpus(3, &[(0, 2)]);
        let pairs = plan_pairs(3, PeerGate::Probe, Some(&link_over(&drivers)));
        assert_eq!(
            peers(&pairs),
            [
                (0, 1, true),
                (0, 2, false),
                (1, 0, true),
                (1, 2, true),
                (2, 0, false),
                (2, 1, true)
            ]
        );
        assert!(
            pairs[1]
                .reason
                .starts_with("self-test failed: a copy of 1 bytes at offset 0 arrived changed"),
            "{}",
            pairs[1]
        );
        // Every buffer and stream of the test was given back.
        for driver in &drivers {
            assert_eq!(driver.used_bytes(), 0);
        }
        let clean = plan_pairs(3, PeerGate::Probe, Some(&link_over(&host_gpus(3, &[]))));
        assert!(clean
            .iter()
            .all(|p| p.peer && p.self_test == SelfTest::Passed));
    }

    #[cfg(unix)]
    #[test]
    fn the_driver_link_says_why_devices_without_peer_access_fall_back() {
        use crate::host::{HostDriver, HostDriverConfig};
        // Two host devices never connected: neither reaches the other.
        let drivers: Vec<Arc<HostDriver>> = (0..2)
            .map(|ordinal| {
                Arc::new(HostDriver::new(HostDriverConfig {
                    ordinal,
                    ..HostDriverConfig::default()
                }))
            })
            .collect();
        let pairs = plan_pairs(2, PeerGate::Probe, Some(&link_over(&drivers)));
        assert_eq!(peers(&pairs), [(0, 1, false), (1, 0, false)]);
        assert_eq!(
            pairs[0].reason,
            "self-test failed: a copy of 1 bytes at offset 0 failed: device 1 cannot access the memory of device 0 (no peer access between them)"
        );
        // The gate on trusts them without a test, but they still cannot reach each other.
        let mut trusted = plan_pairs(2, PeerGate::On, Some(&link_over(&drivers)));
        link_over(&drivers).enable_trusted(&mut trusted);
        assert_eq!(peers(&trusted), [(0, 1, false), (1, 0, false)]);
        assert_eq!(
            trusted[1].reason,
            "the peer_copy gate is on, but device 0 cannot access the memory of device 1 (no peer access between them)"
        );
        let connected = host_gpus(2, &[]);
        let mut trusted = plan_pairs(2, PeerGate::On, Some(&link_over(&connected)));
        link_over(&connected).enable_trusted(&mut trusted);
        assert!(trusted.iter().all(|p| p.peer), "{trusted:?}");
        // One GPU named twice: its "peer" copies are device-to-device copies, and pass.
        let one = host_gpus(1, &[]);
        let twice = DriverPeerLink::new(vec![
            (Arc::clone(&one[0]) as Arc<dyn Driver>, 0),
            (Arc::clone(&one[0]) as Arc<dyn Driver>, 0),
        ]);
        let pairs = plan_pairs(2, PeerGate::Probe, Some(&twice));
        assert!(pairs.iter().all(|p| p.peer), "{pairs:?}");
    }

    #[test]
    fn the_corrupt_pair_setting_parses_or_names_the_variable() {
        assert_eq!(SimPeerLink::parse("0,1").unwrap().corrupt_pairs(), [(0, 1)]);
        assert_eq!(
            SimPeerLink::parse(" 0,1 ; 2, 3").unwrap().corrupt_pairs(),
            [(0, 1), (2, 3)]
        );
        assert_eq!(SimPeerLink::parse("").unwrap().corrupt_pairs(), []);
        for bad in ["0", "0,0", "a,1", "0,1,2"] {
            let e = SimPeerLink::parse(bad).unwrap_err();
            assert!(
                e.starts_with("EMBER_SIM_CORRUPT_PEER: expected SRC,DST"),
                "{e}"
            );
        }
    }
}
