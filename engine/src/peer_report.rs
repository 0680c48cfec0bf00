//! The peer-copy state of a set of devices, as `ember devices` and `ember info` show it: the
//! build's `peer_copy` gate (on, off or probe, with its reason) and, for every ordered pair of
//! devices, how copies travel and what the start-up self-test said. One implementation; the
//! commands only print it.

use serde::Serialize;

use ember_gpu::peer::{plan_pairs, PairState, PeerGate, PeerLink};

/// The peer-copy state of a set of devices (`peer_copy` in both commands' JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerReport {
    /// The `peer_copy` gate: `on`, `off` or `probe`.
    pub gate: String,
    pub reason: Option<String>,
    /// Every ordered pair of devices, and how copies between them travel.
    pub pairs: Vec<PairReport>,
}

/// How copies from one device to another travel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PairReport {
    pub src: String,
    pub dst: String,
    pub peer: bool,
    /// Why (the gate, the self-test verdict, or why there is no peer path).
    pub reason: String,
    /// `passed`, `failed` or `not run`.
    pub self_test: String,
}

impl PeerReport {
    /// The state of the GPUs named `names` (`hip:0`, `cuda:1`, in the order listed) under this
    /// build's gate. No self-test runs here: only the load of a split runs it, so a probed pair
    /// says `not run`.
    pub fn for_gpus(names: &[String]) -> PeerReport {
        // A bad EMBER_PEER_COPY, which a load over these GPUs refuses, shows as the reason.
        let (gate, reason) =
            crate::build_manifest::peer_gate().unwrap_or_else(|error| (PeerGate::Off, Some(error)));
        PeerReport::probe(names, gate, reason, None)
    }

    /// The state of the devices named `names` under `gate`, copying over `link` (the self-test
    /// runs over it where the gate is `probe`).
    pub fn probe(
        names: &[String],
        gate: PeerGate,
        reason: Option<String>,
        link: Option<&dyn PeerLink>,
    ) -> PeerReport {
        PeerReport::of_pairs(names, gate, reason, &plan_pairs(names.len(), gate, link))
    }

    /// The report of pairs already decided (`pairs` index `names`).
    pub fn of_pairs(
        names: &[String],
        gate: PeerGate,
        reason: Option<String>,
        pairs: &[PairState],
    ) -> PeerReport {
        PeerReport {
            gate: gate.to_string(),
            reason,
            pairs: pairs
                .iter()
                .map(|p| PairReport {
                    src: names[p.src].clone(),
                    dst: names[p.dst].clone(),
                    peer: p.peer,
                    reason: p.reason.clone(),
                    self_test: p.self_test.to_string(),
                })
                .collect(),
        }
    }

    /// The text lines: the gate, then one line per pair.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "peer    gate {}{}",
            self.gate,
            self.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        )];
        for p in &self.pairs {
            lines.push(format!(
                "          {} -> {}: {} ({}; self-test {})",
                p.src,
                p.dst,
                if p.peer { "peer" } else { "host staging" },
                p.reason,
                p.self_test
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use ember_gpu::peer::SimPeerLink;

    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("sim:{i}")).collect()
    }

    #[test]
    fn every_ordered_pair_gets_its_verdict_and_line() {
        let link = SimPeerLink::corrupting(vec![(1, 2)]);
        let report = PeerReport::probe(
            &names(3),
            PeerGate::Probe,
            Some("the gfx120X report".into()),
            Some(&link),
        );
        assert_eq!(report.gate, "probe");
        let verdicts: Vec<(&str, &str, bool, &str)> = report
            .pairs
            .iter()
            .map(|p| (p.src.as_str(), p.dst.as_str(), p.peer, p.self_test.as_str()))
            .collect();
        assert_eq!(
            verdicts,
            [
                ("sim:0", "sim:1", true, "passed"),
                ("sim:0", "sim:2", true, "passed"),
                ("sim:1", "sim:0", true, "passed"),
                ("sim:1", "sim:2", false, "failed"),
                ("sim:2", "sim:0", true, "passed"),
                ("sim:2", "sim:1", false, "failed"),
            ]
        );
        let lines = report.lines();
        assert_eq!(lines.len(), 7);
        assert_eq!(lines[0], "peer    gate probe (the gfx120X report)");
        assert_eq!(
            lines[1],
            "          sim:0 -> sim:1: peer (self-test passed both ways; self-test passed)"
        );
        assert!(
            lines[4].starts_with(
                "          sim:1 -> sim:2: host staging (self-test failed: a copy of 1 bytes"
            ),
            "{}",
            lines[4]
        );
        assert!(lines[4].ends_with("; self-test failed)"), "{}", lines[4]);
    }

    #[test]
    fn without_a_link_or_with_the_gate_off_nothing_is_tested() {
        let off = PeerReport::probe(&names(2), PeerGate::Off, None, None);
        assert_eq!(off.lines()[0], "peer    gate off");
        assert!(off
            .pairs
            .iter()
            .all(|p| !p.peer && p.self_test == "not run" && p.reason.contains("gate is off")));
        let gpus = PeerReport::for_gpus(&names(1));
        assert!(gpus.pairs.is_empty());
        let (gate, _) = crate::build_manifest::peer_gate().unwrap();
        assert_eq!(gpus.gate, gate.to_string());
    }
}
