//! The build manifest's slot in the engine binary: `engine/src/build_manifest.rs` reserves a
//! static of [`MARKER`], a little-endian `u32` length and [`CAPACITY`] bytes; `cargo xtask build`
//! writes the target's manifest there after linking. One compiled engine then serves every
//! target's package (the build steps of a CI run reuse the engine its tests compiled), and the
//! manifest stays inside the executable, where `ember info` and the engine read it.

use anyhow::{bail, ensure, Context, Result};
use std::path::Path;

/// `MANIFEST_SLOT_MARKER` in engine/src/build_manifest.rs.
pub const MARKER: [u8; 32] = *b"ember:build-manifest-slot:v1:3f9";
/// `MANIFEST_SLOT_CAPACITY` in engine/src/build_manifest.rs.
pub const CAPACITY: usize = 64 * 1024;
const LEN_BYTES: usize = 4;

/// Where the slot's length field starts: right after the one marker in `binary`.
fn slot_offset(binary: &[u8]) -> Result<usize> {
    let mut found = binary
        .windows(MARKER.len())
        .enumerate()
        .filter(|(_, window)| *window == MARKER)
        .map(|(offset, _)| offset);
    let Some(first) = found.next() else {
        bail!(
            "expected the engine's build-manifest slot (marker {:?}) in the binary, found none: was it built from this checkout's engine?",
            String::from_utf8_lossy(&MARKER)
        );
    };
    if let Some(second) = found.next() {
        bail!("expected one build-manifest slot in the binary, found markers at offsets {first} and {second}");
    }
    let start = first + MARKER.len();
    ensure!(
        binary.len() >= start + LEN_BYTES + CAPACITY,
        "the build-manifest slot at offset {first} runs past the end of the binary ({} bytes)",
        binary.len()
    );
    Ok(start)
}

/// `binary` with `json` written into its manifest slot (replacing whatever the slot held).
pub fn write(binary: &[u8], json: &str) -> Result<Vec<u8>> {
    ensure!(
        json.len() <= CAPACITY,
        "the build manifest is {} bytes; the engine's slot holds at most {CAPACITY}",
        json.len()
    );
    let start = slot_offset(binary)?;
    let mut out = binary.to_vec();
    let len = u32::try_from(json.len()).context("manifest length fits in u32")?;
    out[start..start + LEN_BYTES].copy_from_slice(&len.to_le_bytes());
    let bytes = &mut out[start + LEN_BYTES..start + LEN_BYTES + CAPACITY];
    bytes.fill(0);
    bytes[..json.len()].copy_from_slice(json.as_bytes());
    Ok(out)
}

/// The manifest in `binary`'s slot; `None` when the slot is empty (a plain `cargo build`).
pub fn read(binary: &[u8]) -> Result<Option<String>> {
    let start = slot_offset(binary)?;
    let mut len = [0u8; LEN_BYTES];
    len.copy_from_slice(&binary[start..start + LEN_BYTES]);
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 {
        return Ok(None);
    }
    ensure!(
        len <= CAPACITY,
        "the build-manifest slot claims {len} bytes; it holds at most {CAPACITY}"
    );
    let bytes = &binary[start + LEN_BYTES..start + LEN_BYTES + len];
    let json = String::from_utf8(bytes.to_vec())
        .context("the build manifest in the binary is not UTF-8")?;
    Ok(Some(json))
}

/// Copies the engine binary `from` to `to` with `json` in its slot, executable, and reads it
/// back to check.
pub fn stamp(from: &Path, to: &Path, json: &str) -> Result<()> {
    let binary = std::fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    let stamped = write(&binary, json).with_context(|| format!("stamping {}", from.display()))?;
    ensure!(
        read(&stamped)?.as_deref() == Some(json),
        "the manifest read back from the stamped {} differs from the one written",
        to.display()
    );
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(to, stamped).with_context(|| format!("writing {}", to.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_binary() -> Vec<u8> {
        let mut binary = b"\x7fELF code before".to_vec();
        binary.extend_from_slice(&MARKER);
        binary.extend_from_slice(&[0; LEN_BYTES]);
        binary.extend(std::iter::repeat_n(0u8, CAPACITY));
        binary.extend_from_slice(b"code after");
        binary
    }

    #[test]
    fn write_then_read_round_trips_and_leaves_the_rest() {
        let binary = fake_binary();
        assert_eq!(read(&binary).unwrap(), None);
        let stamped = write(&binary, r#"{"target": "gfx1201"}"#).unwrap();
        assert_eq!(stamped.len(), binary.len());
        assert_eq!(
            read(&stamped).unwrap().as_deref(),
            Some(r#"{"target": "gfx1201"}"#)
        );
        assert!(stamped.starts_with(b"\x7fELF code before"));
        assert!(stamped.ends_with(b"code after"));
        // Stamping again replaces the manifest entirely (no tail of the longer one is left).
        let again = write(&stamped, "{}").unwrap();
        assert_eq!(read(&again).unwrap().as_deref(), Some("{}"));
        assert_eq!(write(&binary, "{}").unwrap(), again);
    }

    #[test]
    fn bad_slots_are_errors() {
        let none = b"no slot here".to_vec();
        assert!(read(&none).unwrap_err().to_string().contains("found none"));
        let mut two = fake_binary();
        two.extend(fake_binary());
        assert!(write(&two, "{}")
            .unwrap_err()
            .to_string()
            .contains("expected one build-manifest slot"));
        let mut short = fake_binary();
        short.truncate(MARKER.len() + 100);
        assert!(read(&short)
            .unwrap_err()
            .to_string()
            .contains("runs past the end"));
        let big = "x".repeat(CAPACITY + 1);
        assert!(write(&fake_binary(), &big)
            .unwrap_err()
            .to_string()
            .contains("holds at most"));
    }

    #[test]
    fn layout_matches_the_engine() {
        let engine =
            std::fs::read_to_string(crate::project_root().join("engine/src/build_manifest.rs"))
                .unwrap();
        let marker = format!(
            "MANIFEST_SLOT_MARKER: [u8; 32] = *b\"{}\";",
            String::from_utf8_lossy(&MARKER)
        );
        assert!(engine.contains(&marker), "engine lacks `{marker}`");
        assert!(engine.contains("MANIFEST_SLOT_CAPACITY: usize = 64 * 1024;"));
        assert_eq!(CAPACITY, 64 * 1024);
        assert!(engine.contains(
            "    marker: [u8; 32],\n    len: [u8; 4],\n    bytes: [u8; MANIFEST_SLOT_CAPACITY],"
        ));
    }
}
