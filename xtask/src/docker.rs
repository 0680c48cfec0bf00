//! `cargo xtask docker`: one container image per target, from `docker/Dockerfile` on the base
//! image that `targets.toml` pins for the target (the official ROCm runtime image for AMD GPU
//! targets, a plain Debian image for the CPU target). `--base` swaps the base, which is how CI
//! builds the real Dockerfile on a local debootstrapped image where the official images cannot be
//! pulled.
//!
//! The build context is a folder of its own holding only the Dockerfile and the image's one file
//! layer, a tar that xtask prepares ([`layer`]: the artifact, checked against its `SHA256SUMS`, the
//! scripts of `docker/`, the `ember` user added to the base's account files), so nothing else of the
//! checkout is sent to the daemon or can end up in the image, and two builds of one commit give the
//! same layer digests with the classic builder. `--check-reproducible` builds the image a second
//! time with `--no-cache` and compares `RootFS.Layers`; the image configs differ (`created`).
//!
//! This module also reads what `targets.toml` implies for a target's build manifest (features with
//! state and reason) and compares a package's `manifest.json` with it; `cargo xtask smoke` uses
//! both.

mod layer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use xshell::{cmd, Shell};

use crate::targets::{self, Feature, FeatureState, Os, Target};
use crate::{build, manifest, package};

/// The build context: the Dockerfile and the file layer it ADDs at `/`.
const DOCKERFILE: &str = "Dockerfile";
const LAYER_FILE: &str = "ember-layer.tar";

/// Image labels the Dockerfile sets and the smoke test reads back.
pub const LABEL_TARGET: &str = "io.ember.target";
pub const LABEL_VERSION: &str = "org.opencontainers.image.version";
pub const LABEL_RUN: &str = "io.ember.run";

/// What a ROCm container needs to reach the GPU: the compute and render device nodes, the group
/// that owns them, and no seccomp filter (the ROCm runtime makes calls the default profile blocks).
/// The Dockerfile's `io.ember.run` label and docker/README.md document the same.
pub const GPU_RUN_ARGS: [&str; 8] = [
    "--device",
    "/dev/kfd",
    "--device",
    "/dev/dri",
    "--group-add",
    "video",
    "--security-opt",
    "seccomp=unconfined",
];

impl crate::flags::Docker {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let root = crate::project_root();
        let started = Instant::now();
        // Fails on a target name targets.toml does not know, before anything is built.
        let targets = targets::load()?;
        let target = targets.target(&self.target)?;
        let version = manifest::workspace_version(&root)?;
        let artifact = package::archive_path(&version, Os::Linux, &target.name);
        if artifact.is_file() {
            println!("docker: using {}", artifact.display());
        } else {
            println!("docker: {} is missing; building it", artifact.display());
            let built = build::build(sh, &root, &targets, &target.name, Os::Linux, &version)?;
            if built != artifact {
                bail!(
                    "expected `cargo xtask build` to write {}, found {}",
                    artifact.display(),
                    built.display()
                );
            }
        }
        let base = match self.base {
            Some(base) => base,
            None => {
                let image = targets.default_base_image(target)?;
                if !image.is_pinned() {
                    eprintln!(
                        "warning: base image {} is not pinned by digest in targets.toml; a release build refuses it",
                        image.tag
                    );
                }
                image.reference()
            }
        };
        let image = ImageBuild::new(
            &root,
            &artifact,
            &target.name,
            &version,
            &base,
            package::source_date_epoch(&root),
        )?;
        let tag = image_tag(&version, &target.name);
        let contexts = crate::target_dir().join("docker-context");
        image.build(sh, &tag, &contexts.join(&target.name), false)?;
        println!(
            "docker: built {tag} in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        if self.check_reproducible {
            let again = contexts.join(format!("{}-repro-check", target.name));
            check_layers_reproducible(sh, &image, &tag, &again)?;
        }
        println!("docker: smoke-test it with `cargo xtask smoke --image {tag}`");
        Ok(())
    }
}

/// What one image is built from.
struct ImageBuild {
    root: PathBuf,
    artifact: PathBuf,
    /// The package's folder name inside the artifact.
    stem: String,
    base: String,
    version: String,
    target: String,
    source: String,
    /// `SOURCE_DATE_EPOCH`: the time of every entry of the image's file layer.
    epoch: u64,
}

impl ImageBuild {
    /// What `cargo xtask docker` builds for `target` from `artifact`, with the `docker/` files
    /// of the checkout `root`.
    fn new(
        root: &Path,
        artifact: &Path,
        target: &str,
        version: &str,
        base: &str,
        epoch: u64,
    ) -> Result<ImageBuild> {
        Ok(ImageBuild {
            root: root.to_path_buf(),
            artifact: artifact.to_path_buf(),
            stem: package::package_stem(version, Os::Linux, target),
            base: base.to_string(),
            version: version.to_string(),
            target: target.to_string(),
            source: workspace_repository(root)?,
            epoch,
        })
    }

    /// Prepares a build context of its own in `context_dir` (the Dockerfile and the file layer)
    /// and builds `tag` from it; `no_cache` rebuilds every step.
    fn build(&self, sh: &Shell, tag: &str, context_dir: &Path, no_cache: bool) -> Result<()> {
        if context_dir.exists() {
            std::fs::remove_dir_all(context_dir).with_context(|| {
                format!(
                    "removing the previous build context {}",
                    context_dir.display()
                )
            })?;
        }
        std::fs::create_dir_all(context_dir)?;
        std::fs::copy(
            self.root.join("docker").join(DOCKERFILE),
            context_dir.join(DOCKERFILE),
        )
        .with_context(|| format!("copying docker/{DOCKERFILE} into the build context"))?;

        // Read once and checked against the package's `.sha256`: an archive caught mid-write by a
        // concurrent build is refused rather than packed.
        let artifact = std::fs::read(&self.artifact)
            .with_context(|| format!("reading {}", self.artifact.display()))?;
        crate::smoke::verify_archive_digest(&self.artifact, &package::sha256_hex(&artifact))?;
        let script = |name: &str| {
            let path = self.root.join("docker").join(name);
            std::fs::read(&path).with_context(|| format!("reading {}", path.display()))
        };
        let inputs = layer::Inputs {
            artifact: &artifact,
            stem: &self.stem,
            entrypoint: script("entrypoint.sh")?,
            healthcheck: script("healthcheck.sh")?,
            epoch: self.epoch,
        };
        let base_files = read_base_files(sh, &self.base)?;
        let file_layer = layer::image_layer(&inputs, &base_files).with_context(|| {
            format!(
                "preparing the image's file layer from {}",
                self.artifact.display()
            )
        })?;
        let layer_path = context_dir.join(LAYER_FILE);
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(&layer_path)
                .with_context(|| format!("creating {}", layer_path.display()))?,
        );
        file_layer.write(&mut out, self.epoch)?;
        out.into_inner()
            .map_err(|error| error.into_error())?
            .sync_all()?;

        let (base, version, target, source) =
            (&self.base, &self.version, &self.target, &self.source);
        let no_cache = no_cache.then_some("--no-cache");
        println!("docker: building {tag} on {base}");
        cmd!(
            sh,
            "docker build {no_cache...} --build-arg BASE_IMAGE={base} --build-arg EMBER_VERSION={version} --build-arg EMBER_TARGET={target} --build-arg EMBER_SOURCE={source} --tag {tag} {context_dir}"
        )
        .run()
        .with_context(|| format!("building image {tag} (is dockerd running? .ci/setup-docker.sh starts one)"))?;
        std::fs::remove_dir_all(context_dir)?;
        Ok(())
    }
}

/// The file layers of the image built with `--no-cache` for `target` from `artifact` and the
/// `docker/` files of the checkout `root`, in the build context `context_dir`, under `tag`, which
/// is removed afterwards. `cargo xtask repro --base` compares two builds' images with it.
pub fn fresh_image_layers(
    sh: &Shell,
    (root, artifact): (&Path, &Path),
    (target, version): (&str, &str),
    base: &str,
    epoch: u64,
    (context_dir, tag): (&Path, &str),
) -> Result<Vec<String>> {
    let image = ImageBuild::new(root, artifact, target, version, base, epoch)?;
    let layers = image
        .build(sh, tag, context_dir, true)
        .and_then(|()| image_layers(sh, tag));
    let removed = cmd!(sh, "docker image rm {tag}")
        .quiet()
        .ignore_stdout()
        .run();
    let layers = layers?;
    removed.with_context(|| format!("removing {tag}"))?;
    Ok(layers)
}

/// The image's file layers (`RootFS.Layers`: the digests of the uncompressed layer tars, base
/// layers first).
pub fn image_layers(sh: &Shell, tag: &str) -> Result<Vec<String>> {
    let format = "{{json .RootFS.Layers}}";
    let layers = cmd!(sh, "docker image inspect --format {format} {tag}")
        .quiet()
        .read()
        .with_context(|| format!("inspecting {tag}"))?;
    serde_json::from_str(&layers).with_context(|| format!("reading {tag}'s layers: {layers}"))
}

/// Builds the image again with `--no-cache`, from a fresh build context in another folder and
/// the same artifact, and checks that its file layers are byte-identical to `tag`'s (same
/// digests). The image configs differ (their `created` times), so the image ids do too. The
/// second image is removed either way.
fn check_layers_reproducible(
    sh: &Shell,
    image: &ImageBuild,
    tag: &str,
    context_dir: &Path,
) -> Result<()> {
    let started = Instant::now();
    let again = format!("{tag}-repro-check");
    let built = image.build(sh, &again, context_dir, true);
    let compared = built.and_then(|()| Ok((image_layers(sh, tag)?, image_layers(sh, &again)?)));
    let removed = cmd!(sh, "docker image rm {again}")
        .quiet()
        .ignore_stdout()
        .run();
    let (first, second) = compared?;
    removed.with_context(|| format!("removing {again}"))?;
    let problems = compare_layers(&first, &second);
    ensure!(
        problems.is_empty(),
        "two builds of {tag} from the same artifact have different file layers (see them with `docker save`):\n  {}",
        problems.join("\n  ")
    );
    println!(
        "docker: a second build with --no-cache gave the same {} file layers ({:.1} s)",
        first.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Every way two images' layer lists differ, by position.
pub fn compare_layers(first: &[String], second: &[String]) -> Vec<String> {
    let mut problems = Vec::new();
    if first.len() != second.len() {
        problems.push(format!(
            "expected {} layers, found {}",
            first.len(),
            second.len()
        ));
    }
    for (index, (a, b)) in first.iter().zip(second).enumerate() {
        if a != b {
            problems.push(format!("layer {index}: {a} then {b}"));
        }
    }
    problems
}

/// Reads the files the layer takes from the base image (its account files, `/etc/login.defs`,
/// `/etc/skel`, and the metadata of the directories the layer writes into) with the base's own
/// `tar`, as root, with no network. Missing paths are left out (`--ignore-failed-read`).
fn read_base_files(sh: &Shell, base: &str) -> Result<layer::BaseFiles> {
    let absolute = |path: &&str| format!("/{path}");
    let dirs: Vec<String> = layer::BASE_DIRS.iter().map(absolute).collect();
    let files: Vec<String> = layer::BASE_FILES.iter().map(absolute).collect();
    let skel = absolute(&layer::BASE_SKEL);
    let output = cmd!(
        sh,
        "docker run --rm --user 0:0 --network none --entrypoint tar {base} --create --file - --numeric-owner --ignore-failed-read --no-recursion {dirs...} {files...} --recursion {skel}"
    )
    .quiet()
    .ignore_status()
    .output()
    .with_context(|| format!("running tar in the base image {base} (is dockerd running? .ci/setup-docker.sh starts one)"))?;
    if !output.status.success() {
        bail!(
            "reading /etc/passwd and the other account files from the base image {base} with its tar failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    layer::BaseFiles::from_tar(&output.stdout)
        .with_context(|| format!("reading the files of the base image {base}"))
}
/// `ember:<version>-<target>`.
pub fn image_tag(version: &str, target: &str) -> String {
    format!("ember:{version}-{target}")
}

/// The repository URL (`[workspace.package] repository`), for the image's source label.
fn workspace_repository(root: &Path) -> Result<String> {
    let path = root.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let cargo_toml: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    cargo_toml
        .get("workspace")
        .and_then(|workspace| workspace.get("package"))
        .and_then(|package| package.get("repository"))
        .and_then(toml::Value::as_str)
        .map(str::to_string)
        .with_context(|| {
            format!(
                "expected [workspace.package] repository in {}, found none",
                path.display()
            )
        })
}

// ---------------------------------------------------------------------------------------------
// What targets.toml implies for one target's build manifest.

/// The part of a build manifest that targets.toml decides: the target and its feature gates
/// (after family inheritance, sorted by name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectedManifest {
    pub target: String,
    pub features: Vec<Feature>,
}

impl ExpectedManifest {
    pub fn of(target: &Target) -> ExpectedManifest {
        ExpectedManifest {
            target: target.name.clone(),
            features: target.features.clone(),
        }
    }
}

/// Every way a package's `manifest.json` disagrees with what targets.toml implies. The features may
/// be an object keyed by name or an array of objects with a `name`; each has `state`, and `reason`
/// and `tracking` where targets.toml has them. Features targets.toml does not name are an error
/// too: a manifest that claims more than the gate table is as wrong as one that claims less.
pub fn compare_manifest_json(
    expected: &ExpectedManifest,
    manifest: &serde_json::Value,
) -> Vec<String> {
    let mut problems = Vec::new();
    match manifest.get("target").and_then(serde_json::Value::as_str) {
        Some(target) if target == expected.target => {}
        Some(target) => problems.push(format!(
            "expected target {}, found {target}",
            expected.target
        )),
        None => problems.push(format!(
            "expected \"target\": \"{}\", found none",
            expected.target
        )),
    }
    let mut found: BTreeMap<String, &serde_json::Value> = BTreeMap::new();
    match manifest.get("features") {
        Some(serde_json::Value::Object(map)) => {
            found.extend(map.iter().map(|(name, value)| (name.clone(), value)))
        }
        Some(serde_json::Value::Array(items)) => {
            for item in items {
                match item.get("name").and_then(serde_json::Value::as_str) {
                    Some(name) => {
                        found.insert(name.to_string(), item);
                    }
                    None => problems.push(format!("expected a name in each feature, found {item}")),
                }
            }
        }
        Some(other) => problems.push(format!(
            "expected \"features\" as an object or array, found {other}"
        )),
        None => problems.push("expected \"features\", found none".to_string()),
    }
    for feature in &expected.features {
        let Some(value) = found.remove(&feature.name) else {
            problems.push(format!(
                "expected feature {} ({}), found none",
                feature.name,
                feature.state.name()
            ));
            continue;
        };
        let state = value.get("state").and_then(serde_json::Value::as_str);
        if state != Some(feature.state.name()) {
            problems.push(format!(
                "expected feature {} to be {}, found {}",
                feature.name,
                feature.state.name(),
                state.unwrap_or("no state")
            ));
        }
        // The engine reads `enabled` as the run-time default; it must agree with `state`.
        if let Some(enabled) = value.get("enabled") {
            let expected_enabled = feature.state == FeatureState::On;
            if enabled.as_bool() != Some(expected_enabled) {
                problems.push(format!(
                    "expected feature {} to have \"enabled\": {expected_enabled}, found {enabled}",
                    feature.name
                ));
            }
        }
        let reason = value.get("reason").and_then(serde_json::Value::as_str);
        if reason != feature.reason.as_deref() {
            problems.push(format!(
                "expected the reason of feature {} to be {:?}, found {reason:?}",
                feature.name, feature.reason
            ));
        }
        let tracking: Vec<&str> = value
            .get("tracking")
            .and_then(serde_json::Value::as_array)
            .map(|links| links.iter().filter_map(serde_json::Value::as_str).collect())
            .unwrap_or_default();
        if tracking != feature.tracking {
            problems.push(format!(
                "expected the tracking links of feature {} to be {:?}, found {tracking:?}",
                feature.name, feature.tracking
            ));
        }
    }
    for name in found.keys() {
        problems.push(format!(
            "expected only the features of targets.toml, found {name} as well"
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed(target: &str) -> ExpectedManifest {
        ExpectedManifest::of(targets::load().unwrap().target(target).unwrap())
    }

    #[test]
    fn gfx1201_has_vmm_off_with_its_reason_and_links_and_gfx1151_on() {
        let gfx1201 = committed("gfx1201");
        let vmm = gfx1201
            .features
            .iter()
            .find(|feature| feature.name == "vmm")
            .unwrap();
        assert_eq!(vmm.state, FeatureState::Off);
        assert!(vmm.reason.as_deref().unwrap().contains("hipMemSetAccess"));
        assert!(vmm
            .tracking
            .iter()
            .any(|link| link.ends_with("ROCm/rocm-systems/issues/2516")));
        let gfx1151 = committed("gfx1151");
        let vmm = gfx1151
            .features
            .iter()
            .find(|feature| feature.name == "vmm")
            .unwrap();
        assert_eq!((vmm.state, vmm.reason.as_ref()), (FeatureState::On, None));
    }

    fn feature(
        name: &str,
        state: FeatureState,
        reason: Option<&str>,
        tracking: &[&str],
    ) -> Feature {
        Feature {
            name: name.to_string(),
            state,
            reason: reason.map(str::to_string),
            tracking: tracking.iter().map(|link| link.to_string()).collect(),
        }
    }

    fn gfx1201() -> ExpectedManifest {
        ExpectedManifest {
            target: "gfx1201".to_string(),
            features: vec![
                feature("peer_copy", FeatureState::On, None, &[]),
                feature(
                    "vmm",
                    FeatureState::Off,
                    Some("faults"),
                    &["https://example.org/1"],
                ),
            ],
        }
    }

    fn check_manifest(json: &str, problems: &[&str]) {
        let found = compare_manifest_json(&gfx1201(), &serde_json::from_str(json).unwrap());
        assert_eq!(
            found,
            problems
                .iter()
                .map(|problem| problem.to_string())
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn manifest_json_against_targets() {
        let good = r#"{"target":"gfx1201","rocm":"7.0","features":{"vmm":{"state":"off","reason":"faults","tracking":["https://example.org/1"]},"peer_copy":{"state":"on"}}}"#;
        check_manifest(good, &[]);
        check_manifest(
            r#"{"target":"gfx1201","features":[{"name":"vmm","state":"off","reason":"faults","tracking":["https://example.org/1"]},{"name":"peer_copy","state":"on"}]}"#,
            &[],
        );
        check_manifest(
            &good.replace("\"gfx1201\"", "\"gfx1151\""),
            &["expected target gfx1201, found gfx1151"],
        );
        check_manifest(
            &good.replace(r#""state":"off","reason":"faults","#, r#""state":"on","#),
            &[
                "expected feature vmm to be off, found on",
                "expected the reason of feature vmm to be Some(\"faults\"), found None",
            ],
        );
        check_manifest(
            &good.replace(
                r#""peer_copy":{"state":"on"}"#,
                r#""peer_copy":{"state":"on","enabled":false}"#,
            ),
            &["expected feature peer_copy to have \"enabled\": true, found false"],
        );
        check_manifest(
            &good.replace(
                r#""peer_copy":{"state":"on"}"#,
                r#""peer_copy":{"state":"on","enabled":true}"#,
            ),
            &[],
        );
        check_manifest(
            &good.replace(r#","tracking":["https://example.org/1"]"#, ""),
            &["expected the tracking links of feature vmm to be [\"https://example.org/1\"], found []"],
        );
        check_manifest(
            &good.replace(r#","peer_copy":{"state":"on"}"#, ""),
            &["expected feature peer_copy (on), found none"],
        );
        check_manifest(
            &good.replace(
                r#""peer_copy":{"state":"on"}"#,
                r#""peer_copy":{"state":"on"},"xnack":{"state":"on"}"#,
            ),
            &["expected only the features of targets.toml, found xnack as well"],
        );
        check_manifest(
            r#"{"features":{}}"#,
            &[
                "expected \"target\": \"gfx1201\", found none",
                "expected feature peer_copy (on), found none",
                "expected feature vmm (off), found none",
            ],
        );
    }

    #[test]
    fn layer_lists_are_compared_by_position() {
        let layers = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            compare_layers(&layers(&["a", "b"]), &layers(&["a", "b"])),
            Vec::<String>::new()
        );
        assert_eq!(
            compare_layers(&layers(&["a", "b"]), &layers(&["a", "c"])),
            vec!["layer 1: b then c"]
        );
        assert_eq!(
            compare_layers(&layers(&["a", "b"]), &layers(&["a"])),
            vec!["expected 2 layers, found 1"]
        );
    }

    #[test]
    fn image_tags() {
        assert_eq!(image_tag("0.1.0", "gfx1201"), "ember:0.1.0-gfx1201");
    }

    /// Lint-like checks of docker/Dockerfile: what the image promises users and the smoke test.
    #[test]
    fn dockerfile_promises() {
        let text =
            std::fs::read_to_string(crate::project_root().join("docker/Dockerfile")).unwrap();
        let instructions = dockerfile_instructions(&text);
        let find = |keyword: &str| -> Vec<&str> {
            instructions
                .iter()
                .filter(|(k, _)| k == keyword)
                .map(|(_, rest)| rest.as_str())
                .collect()
        };
        // The base is a build argument declared before FROM and used by it, with no default: the
        // pinned default lives in targets.toml.
        let first_from = instructions
            .iter()
            .position(|(k, _)| k == "FROM")
            .expect("a FROM");
        assert!(instructions[..first_from]
            .iter()
            .any(|(k, rest)| k == "ARG" && rest == "BASE_IMAGE"));
        assert_eq!(find("FROM"), vec!["${BASE_IMAGE}"]);
        // A non-root user is the last USER, so everything at run time is unprivileged.
        let user = *find("USER").last().expect("a USER instruction");
        assert!(!["root", "0", "0:0"].contains(&user), "USER {user}");
        let healthcheck = find("HEALTHCHECK");
        assert_eq!(healthcheck.len(), 1);
        assert!(
            healthcheck[0].ends_with("CMD [\"/usr/local/bin/ember-healthcheck\"]"),
            "{healthcheck:?}"
        );
        assert_eq!(
            find("ENTRYPOINT"),
            vec!["[\"/usr/local/bin/ember-entrypoint\"]"]
        );
        assert_eq!(find("CMD"), vec!["[\"serve\"]"]);
        assert_eq!(find("EXPOSE"), vec!["8080"]);
        assert_eq!(find("ENV"), vec!["EMBER_MODELS_DIR=/models"]);
        assert_eq!(find("VOLUME"), vec!["[\"/models\"]"]);
        let labels = find("LABEL").join(" ");
        for label in [
            LABEL_TARGET,
            LABEL_VERSION,
            LABEL_RUN,
            "org.opencontainers.image.source",
        ] {
            assert!(
                labels.contains(&format!("{label}=")),
                "label {label} missing"
            );
        }
        for pair in GPU_RUN_ARGS.chunks(2) {
            assert!(
                labels.contains(&pair.join(" ")),
                "run label lacks {}",
                pair.join(" ")
            );
        }
        // The file layer xtask prepares is the only context input, added at `/`, and no step
        // runs in the image: a RUN's changes would carry the times of the build.
        let inputs: Vec<&str> = find("ADD").into_iter().chain(find("COPY")).collect();
        assert_eq!(inputs, vec![format!("{LAYER_FILE} /")]);
        assert_eq!(find("RUN"), Vec::<&str>::new());
        // USER and WORKDIR name what the layer creates.
        assert_eq!(find("USER"), vec![layer::USER]);
        assert_eq!(find("WORKDIR"), vec![format!("/{}", layer::HOME)]);
        assert_eq!(
            find("ENTRYPOINT"),
            vec![format!("[\"/{}\"]", layer::ENTRYPOINT)]
        );
        assert!(healthcheck[0].ends_with(&format!("CMD [\"/{}\"]", layer::HEALTHCHECK)));
        assert_eq!(find("VOLUME"), vec![format!("[\"/{}\"]", layer::MODELS)]);
        let readme =
            std::fs::read_to_string(crate::project_root().join("docker/README.md")).unwrap();
        for pair in GPU_RUN_ARGS.chunks(2) {
            assert!(
                readme.contains(&pair.join(" ")),
                "docker/README.md lacks {}",
                pair.join(" ")
            );
        }
    }

    /// (KEYWORD, arguments) per instruction, with comments dropped and continuation lines joined.
    fn dockerfile_instructions(text: &str) -> Vec<(String, String)> {
        let mut instructions = Vec::new();
        let mut current = String::new();
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
                continue;
            }
            if let Some(continued) = trimmed.strip_suffix('\\') {
                current.push_str(continued);
                current.push(' ');
                continue;
            }
            current.push_str(trimmed);
            let (keyword, rest) = current
                .split_once(char::is_whitespace)
                .unwrap_or((current.as_str(), ""));
            instructions.push((
                keyword.to_uppercase(),
                rest.split_whitespace().collect::<Vec<_>>().join(" "),
            ));
            current.clear();
        }
        instructions
    }

    #[test]
    fn dockerfile_parser_joins_continuations() {
        let parsed =
            dockerfile_instructions("# c\nARG A\nRUN a \\\n    # inner\n    b\n\nUSER x\n");
        assert_eq!(
            parsed,
            vec![
                ("ARG".into(), "A".into()),
                ("RUN".into(), "a b".into()),
                ("USER".into(), "x".into())
            ]
        );
    }
}
