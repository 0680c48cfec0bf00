//! Ed25519 signatures over a release's `SHA256SUMS` for the dry run (`cargo xtask release
//! --dry-run`): a throwaway key made for each run, its public half written beside the signature so
//! `cargo xtask verify` can check the rehearsal end to end. The real release signs with keyless
//! Sigstore (`cosign sign-blob`), whose bundle users check with `cosign verify-blob`.
//!
//! Files: `SHA256SUMS.ed25519.sig` (the 64-byte signature in hex) and `release-key.ed25519.pub`
//! (the 32-byte public key in hex), each one line.

use std::path::Path;

use anyhow::{bail, Context, Result};
use ring::signature::{self, Ed25519KeyPair, KeyPair};

pub const SIGNATURE_FILE: &str = "SHA256SUMS.ed25519.sig";
pub const PUBLIC_KEY_FILE: &str = "release-key.ed25519.pub";

/// A fresh key pair, held only in memory.
pub struct ThrowawayKey {
    pair: Ed25519KeyPair,
}

impl ThrowawayKey {
    pub fn generate() -> Result<ThrowawayKey> {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng)
            .map_err(|_| anyhow::anyhow!("generating an Ed25519 key failed"))?;
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref())
            .map_err(|_| anyhow::anyhow!("reading back the generated Ed25519 key failed"))?;
        Ok(ThrowawayKey { pair })
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.pair.public_key().as_ref())
    }

    pub fn sign_hex(&self, message: &[u8]) -> String {
        hex::encode(self.pair.sign(message).as_ref())
    }

    /// Signs `dir/SHA256SUMS` and writes the signature and the public key beside it.
    pub fn sign_release(&self, dir: &Path) -> Result<()> {
        let sums = std::fs::read(dir.join("SHA256SUMS"))
            .with_context(|| format!("reading {}", dir.join("SHA256SUMS").display()))?;
        std::fs::write(
            dir.join(SIGNATURE_FILE),
            format!("{}\n", self.sign_hex(&sums)),
        )?;
        std::fs::write(
            dir.join(PUBLIC_KEY_FILE),
            format!("{}\n", self.public_key_hex()),
        )?;
        Ok(())
    }
}

/// Checks the hex `signature` of `message` against the hex `public_key`; the error says which of
/// the two is malformed or that the signature does not match.
pub fn verify_hex(public_key: &str, message: &[u8], signature: &str) -> Result<()> {
    let key = hex::decode(public_key.trim())
        .ok()
        .filter(|k| k.len() == 32)
        .context("the public key is not 32 bytes of hex")?;
    let sig = hex::decode(signature.trim())
        .ok()
        .filter(|s| s.len() == 64)
        .context("the signature is not 64 bytes of hex")?;
    if signature::UnparsedPublicKey::new(&signature::ED25519, key)
        .verify(message, &sig)
        .is_err()
    {
        bail!("the signature does not match the signed file under this public key");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_and_any_change_fails() {
        let key = ThrowawayKey::generate().unwrap();
        let message = b"0123  ember-0.1.0-linux-cpu-x64.tar.gz\n";
        let sig = key.sign_hex(message);
        verify_hex(&key.public_key_hex(), message, &sig).unwrap();
        // Another message, another key, a flipped signature bit, garbage: each fails.
        assert!(verify_hex(&key.public_key_hex(), b"other", &sig).is_err());
        let other = ThrowawayKey::generate().unwrap();
        assert!(verify_hex(&other.public_key_hex(), message, &sig).is_err());
        let mut flipped = hex::decode(&sig).unwrap();
        flipped[0] ^= 1;
        assert!(verify_hex(&key.public_key_hex(), message, &hex::encode(flipped)).is_err());
        let error = verify_hex(&key.public_key_hex(), message, "zz").unwrap_err();
        assert!(
            error.to_string().contains("signature is not 64 bytes"),
            "{error}"
        );
    }
}
