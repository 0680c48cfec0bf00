//! The software bill of materials: which crates go into the engine binary (from `cargo metadata`'s
//! resolved dependency graph, for one platform), written as a CycloneDX 1.5 JSON document together
//! with the kernel toolchain and the base images the release uses.
//!
//! The same crate list is embedded in every build manifest (`dependencies`, the idea of
//! `cargo auditable` without its extra tool), so `cargo xtask verify` can check a release's SBOM
//! against what each binary says it was built from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// One crate linked into the engine.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Crate {
    pub name: String,
    pub version: String,
    /// The SPDX licence expression from the crate's manifest; `None` when it declares only a
    /// licence file.
    pub license: Option<String>,
}

impl Crate {
    /// `name@version`, the form the build manifest embeds.
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

/// The crates compiled into the `ember` binary for `rust_target`: the `ember` package and
/// everything it reaches through normal (not build or dev) dependencies that apply to that
/// platform, sorted by name and version. The lock file decides: the target's locked crates are
/// fetched (`--locked`), then read with `--locked --offline`.
pub fn engine_crates(root: &Path, rust_target: &str) -> Result<Vec<Crate>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    // `cargo metadata --filter-platform` still needs the manifest of every locked package that
    // applies to the platform, dev-dependencies included, and a machine that has built only for
    // its host lacks the target's own crates (Windows ones on Linux). Fetch them first, locked:
    // a no-op when they are cached, and the build that follows needs them anyway.
    let fetched = std::process::Command::new(&cargo)
        .args(["fetch", "--locked", "--target", rust_target])
        .current_dir(root)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .status()
        .with_context(|| format!("running `{cargo} fetch`"))?;
    if !fetched.success() {
        bail!(
            "`{cargo} fetch --locked --target {rust_target}` failed ({fetched}): the crates of \
             Cargo.lock for {rust_target} could not be fetched; check the network or cargo's \
             registry settings"
        );
    }
    let output = std::process::Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--offline",
            "--filter-platform",
            rust_target,
        ])
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running `{cargo} metadata`"))?;
    if !output.status.success() {
        bail!(
            "`{cargo} metadata --locked --offline` failed ({})",
            output.status
        );
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("parsing `cargo metadata` output")?;
    crates_of(&metadata, "ember")
}

/// The normal-dependency closure of the workspace package `root_name` in `cargo metadata` output.
fn crates_of(metadata: &serde_json::Value, root_name: &str) -> Result<Vec<Crate>> {
    let packages = metadata["packages"]
        .as_array()
        .context("`cargo metadata`: expected a packages array, found none")?;
    let by_id: BTreeMap<&str, &serde_json::Value> = packages
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let members: BTreeSet<&str> = metadata["workspace_members"]
        .as_array()
        .context("`cargo metadata`: expected workspace_members, found none")?
        .iter()
        .filter_map(serde_json::Value::as_str)
        .collect();
    let root_id = members
        .iter()
        .copied()
        .find(|id| by_id.get(id).and_then(|p| p["name"].as_str()) == Some(root_name))
        .with_context(|| format!("`cargo metadata`: no workspace package named {root_name}"))?;
    let nodes: BTreeMap<&str, &serde_json::Value> = metadata["resolve"]["nodes"]
        .as_array()
        .context("`cargo metadata`: expected a resolve graph, found none")?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();

    let mut seen = BTreeSet::from([root_id]);
    let mut queue = vec![root_id];
    while let Some(id) = queue.pop() {
        let node = nodes
            .get(id)
            .with_context(|| format!("`cargo metadata`: {id} is not in the resolve graph"))?;
        for dep in node["deps"].as_array().into_iter().flatten() {
            // `kind` is null for a normal dependency, "build" or "dev" otherwise: build scripts and
            // tests do not end up in the binary.
            let normal = dep["dep_kinds"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k["kind"].is_null());
            if let (true, Some(dep_id)) = (normal, dep["pkg"].as_str()) {
                if seen.insert(dep_id) {
                    queue.push(dep_id);
                }
            }
        }
    }
    let mut crates: Vec<Crate> = seen
        .iter()
        .map(|id| {
            let package = by_id
                .get(id)
                .with_context(|| format!("`cargo metadata`: no package {id}"))?;
            Ok(Crate {
                name: package["name"].as_str().unwrap_or_default().to_string(),
                version: package["version"].as_str().unwrap_or_default().to_string(),
                license: package["license"].as_str().map(str::to_string),
            })
        })
        .collect::<Result<_>>()?;
    crates.sort();
    Ok(crates)
}

/// A component of the SBOM that is not a crate: the kernel compiler, a base image.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Tool {
    /// CycloneDX component type: `application` for a compiler, `container` for an image.
    pub kind: &'static str,
    pub name: String,
    pub version: String,
    /// What the release uses it for (a CycloneDX property).
    pub role: String,
}

#[derive(Serialize)]
struct Document<'a> {
    #[serde(rename = "bomFormat")]
    bom_format: &'a str,
    #[serde(rename = "specVersion")]
    spec_version: &'a str,
    version: u32,
    metadata: Metadata,
    components: Vec<Component>,
}

#[derive(Serialize)]
struct Metadata {
    timestamp: String,
    component: Component,
}

#[derive(Serialize)]
struct Component {
    #[serde(rename = "type")]
    kind: String,
    #[serde(rename = "bom-ref")]
    bom_ref: String,
    name: String,
    version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    purl: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    licenses: Vec<License>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    properties: Vec<Property>,
}

#[derive(Serialize)]
struct License {
    expression: String,
}

#[derive(Serialize)]
struct Property {
    name: String,
    value: String,
}

/// The CycloneDX JSON document for `version` of ember: every crate of `crates` (with purl and
/// licence), then `tools`. Deterministic: sorted components, and the timestamp is
/// `source_date_epoch`, not the clock, so two dry runs of one commit write the same bytes.
pub fn cyclonedx(
    version: &str,
    crates: &[Crate],
    tools: &[Tool],
    source_date_epoch: u64,
) -> Result<String> {
    let mut components: Vec<Component> = crates
        .iter()
        .map(|c| Component {
            kind: "library".into(),
            bom_ref: format!("pkg:cargo/{}@{}", c.name, c.version),
            name: c.name.clone(),
            version: c.version.clone(),
            purl: Some(format!("pkg:cargo/{}@{}", c.name, c.version)),
            licenses: c
                .license
                .iter()
                .map(|expression| License {
                    expression: expression.clone(),
                })
                .collect(),
            properties: Vec::new(),
        })
        .collect();
    let mut tools = tools.to_vec();
    tools.sort();
    tools.dedup();
    components.extend(tools.iter().map(|t| Component {
        kind: t.kind.into(),
        bom_ref: format!("{}:{}@{}", t.kind, t.name, t.version),
        name: t.name.clone(),
        version: t.version.clone(),
        purl: None,
        licenses: Vec::new(),
        properties: vec![Property {
            name: "ember:role".into(),
            value: t.role.clone(),
        }],
    }));
    let document = Document {
        bom_format: "CycloneDX",
        spec_version: "1.5",
        version: 1,
        metadata: Metadata {
            timestamp: rfc3339(source_date_epoch),
            component: Component {
                kind: "application".into(),
                bom_ref: format!("pkg:cargo/ember@{version}"),
                name: "ember".into(),
                version: version.into(),
                purl: Some(format!("pkg:cargo/ember@{version}")),
                licenses: vec![License {
                    expression: "MIT OR Apache-2.0".into(),
                }],
                properties: Vec::new(),
            },
        },
        components,
    };
    let mut json = serde_json::to_string_pretty(&document)?;
    json.push('\n');
    Ok(json)
}

/// The `name@version` of every crate (`pkg:cargo/...` purl) an SBOM lists.
pub fn sbom_crates(sbom: &str) -> Result<BTreeSet<String>> {
    let document: serde_json::Value = serde_json::from_str(sbom).context("not a JSON document")?;
    if document["bomFormat"].as_str() != Some("CycloneDX") {
        bail!(
            "expected \"bomFormat\": \"CycloneDX\", found {}",
            document["bomFormat"]
        );
    }
    let components = document["components"]
        .as_array()
        .context("expected a components array, found none")?;
    Ok(components
        .iter()
        .filter_map(|c| c["purl"].as_str()?.strip_prefix("pkg:cargo/"))
        .map(str::to_string)
        .collect())
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since the epoch.
fn rfc3339(seconds: u64) -> String {
    let (year, month, day) = crate::package::civil_from_days((seconds / 86_400) as i64);
    let secs = seconds % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        (secs % 3600) / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A graph shaped like `cargo metadata`'s: ember -> a (normal) -> c (normal), ember -> b
    /// (build only), a -> d (dev only).
    fn metadata() -> serde_json::Value {
        let package = |name: &str, license: Option<&str>| serde_json::json!({"id": format!("{name}-id"), "name": name, "version": "1.0.0", "license": license});
        let dep = |name: &str, kind: Option<&str>| serde_json::json!({"pkg": format!("{name}-id"), "dep_kinds": [{"kind": kind}]});
        serde_json::json!({
            "packages": [package("ember", Some("MIT OR Apache-2.0")), package("a", Some("MIT")),
                         package("b", None), package("c", Some("Apache-2.0")), package("d", None)],
            "workspace_members": ["ember-id"],
            "resolve": {"nodes": [
                {"id": "ember-id", "deps": [dep("a", None), dep("b", Some("build"))]},
                {"id": "a-id", "deps": [dep("c", None), dep("d", Some("dev"))]},
                {"id": "b-id", "deps": []},
                {"id": "c-id", "deps": []},
                {"id": "d-id", "deps": []},
            ]}
        })
    }

    #[test]
    fn only_normal_dependencies_reach_the_binary() {
        let crates = crates_of(&metadata(), "ember").unwrap();
        let ids: Vec<String> = crates.iter().map(Crate::id).collect();
        assert_eq!(ids, ["a@1.0.0", "c@1.0.0", "ember@1.0.0"]);
        assert_eq!(crates[0].license.as_deref(), Some("MIT"));
    }

    #[test]
    fn the_sbom_lists_crates_with_licences_and_the_toolchain() {
        let crates = crates_of(&metadata(), "ember").unwrap();
        let tools = [Tool {
            kind: "application",
            name: "clang".into(),
            version: "19.1.7".into(),
            role: "kernel compiler".into(),
        }];
        let sbom = cyclonedx("0.1.0", &crates, &tools, 1_796_020_765).unwrap();
        let document: serde_json::Value = serde_json::from_str(&sbom).unwrap();
        assert_eq!(document["metadata"]["timestamp"], "2026-11-30T06:39:25Z");
        assert_eq!(
            document["components"][0]["licenses"][0]["expression"],
            "MIT"
        );
        assert_eq!(document["components"][3]["name"], "clang");
        let listed: Vec<String> = sbom_crates(&sbom).unwrap().into_iter().collect();
        assert_eq!(listed, ["a@1.0.0", "c@1.0.0", "ember@1.0.0"]);
        assert!(sbom_crates("{\"bomFormat\": \"SPDX\"}").is_err());
    }

    #[test]
    fn the_engine_crates_come_from_the_lock_file() {
        let root = crate::project_root();
        let crates = engine_crates(&root, "x86_64-unknown-linux-gnu").unwrap();
        let names: BTreeSet<&str> = crates.iter().map(|c| c.name.as_str()).collect();
        // The engine links the GGUF parser and the server; it never links xtask or criterion
        // (a dev dependency).
        assert!(
            names.contains("ember") && names.contains("axum"),
            "{names:?}"
        );
        assert!(
            !names.contains("xtask") && !names.contains("criterion"),
            "{names:?}"
        );
    }
}
