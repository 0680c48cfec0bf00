//! `targets.toml`: the target matrix, read into typed structs and validated.
//!
//! Everything else in xtask (kernels, build, package, matrix, docker, smoke) asks this module what
//! a target is. Validation is strict because a typo here silently changes a shipped artifact:
//! unknown names, duplicates and contradictory settings are errors that name the line they came
//! from (toml's spans give byte offsets, which are turned into line numbers).

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use toml::Spanned;

/// The features a target can gate. Names outside this list are typos and are rejected.
pub const KNOWN_FEATURES: &[&str] = &["peer_copy", "vmm"];

/// The schema version this xtask understands.
const SCHEMA: u32 = 1;

/// Loads and validates the workspace's `targets.toml`.
pub fn load() -> Result<Targets> {
    load_from(&crate::project_root().join("targets.toml"))
}

/// Loads and validates a targets file at `path` (tests and `matrix --targets` use other files).
pub fn load_from(path: &Path) -> Result<Targets> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the target matrix {}", path.display()))?;
    Ok(Targets::parse(&text, path)?)
}

/// Every problem found in a targets file, one per line, each naming `file:line`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetsError {
    pub problems: Vec<Problem>,
}

/// One problem in a targets file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: PathBuf,
    /// 1-based line; `None` when the problem concerns the file as a whole.
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.path.display(), self.message),
            None => write!(f, "{}: {}", self.path.display(), self.message),
        }
    }
}

impl fmt::Display for TargetsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = self.problems.len();
        writeln!(
            f,
            "invalid target matrix ({count} problem{}):",
            if count == 1 { "" } else { "s" }
        )?;
        for (index, problem) in self.problems.iter().enumerate() {
            if index > 0 {
                writeln!(f)?;
            }
            write!(f, "  {problem}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TargetsError {}

/// What kind of code a target runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Cpu,
    Amdgpu,
    Nvidia,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Cpu => "cpu",
            Kind::Amdgpu => "amdgpu",
            Kind::Nvidia => "nvidia",
        })
    }
}

/// The operating systems artifacts are built for.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Os {
    Linux,
    Windows,
}

impl Os {
    pub const ALL: [Os; 2] = [Os::Linux, Os::Windows];

    pub fn name(self) -> &'static str {
        match self {
            Os::Linux => "linux",
            Os::Windows => "windows",
        }
    }

    /// The engine executable's file name on this OS.
    pub fn exe_name(self) -> &'static str {
        match self {
            Os::Linux => "ember",
            Os::Windows => "ember.exe",
        }
    }
}

impl fmt::Display for Os {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A feature's state on a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FeatureState {
    On,
    Off,
    Unsupported,
    /// On only where a start-up self-test passes (`peer_copy`: per pair of devices); the
    /// reason says why the feature is not simply on.
    Probe,
}

impl FeatureState {
    pub fn name(self) -> &'static str {
        match self {
            FeatureState::On => "on",
            FeatureState::Off => "off",
            FeatureState::Unsupported => "unsupported",
            FeatureState::Probe => "probe",
        }
    }
}

/// The flash-attention kernel flavour a target's kernels are compiled with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlashAttention {
    /// RDNA3/RDNA4 wave matrix multiply-accumulate.
    Wmma,
    /// CDNA matrix fused multiply-add.
    Mfma,
    /// Plain shared-memory tiles: every other GPU.
    Tile,
}

impl FlashAttention {
    pub fn name(self) -> &'static str {
        match self {
            FlashAttention::Wmma => "wmma",
            FlashAttention::Mfma => "mfma",
            FlashAttention::Tile => "tile",
        }
    }
}

/// One feature gate of one target, after family inheritance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Feature {
    pub name: String,
    pub state: FeatureState,
    /// Why the feature is off or unsupported (or a note on why it is on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Upstream issues to watch before turning an `off` feature on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tracking: Vec<String>,
}

impl Feature {
    /// Whether the feature is built in: on, or probed at run time (`probe`: the build carries
    /// it and a start-up self-test decides where it is used).
    pub fn enabled(&self) -> bool {
        matches!(self.state, FeatureState::On | FeatureState::Probe)
    }
}

/// A container image reference with its optional pinning digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    pub tag: String,
    /// `sha256:...`; `None` until someone records it.
    pub digest: Option<String>,
}

impl Image {
    /// The reference to pull: `tag@digest` when pinned, else the tag.
    pub fn reference(&self) -> String {
        match &self.digest {
            Some(digest) => format!("{}@{digest}", self.tag),
            None => self.tag.clone(),
        }
    }

    pub fn is_pinned(&self) -> bool {
        self.digest.is_some()
    }
}

/// A ROCm release GPU builds are made with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RocmRelease {
    pub version: String,
    pub default: bool,
    pub build_image: Image,
    pub runtime_image: Image,
    pub windows_hip_sdk: Option<String>,
    pub windows_hip_sdk_installer: Option<String>,
    pub hip_runtime_dll: Option<String>,
}

/// The CUDA toolkit NVIDIA targets are built with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cuda {
    pub version: String,
    pub build_image: Image,
}

/// How one OS builds and packages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Platform {
    pub os: Os,
    pub runner: String,
    /// `tar.gz` or `zip`.
    pub archive: String,
    pub rust_target: String,
    pub hip_runtime_libs: Vec<String>,
    pub cpu_runtime_image: Option<Image>,
}

/// A family of targets (one GPU generation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    pub name: String,
    pub kind: Kind,
    pub description: String,
}

/// One build target after validation and family inheritance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub name: String,
    pub family: String,
    pub family_description: String,
    pub kind: Kind,
    pub wave_size: Option<u32>,
    pub flash_attention: Option<FlashAttention>,
    pub platforms: Vec<Os>,
    /// Sorted by name.
    pub features: Vec<Feature>,
    pub min_llvm: Option<u32>,
    /// Labels of the self-hosted runner its smoke test needs; empty: a hosted runner.
    pub runner: Vec<String>,
    /// 1-based line of its `[[target]]` entry.
    pub line: usize,
}

impl Target {
    #[cfg(test)]
    pub fn feature(&self, name: &str) -> Option<&Feature> {
        self.features.iter().find(|feature| feature.name == name)
    }

    pub fn supports(&self, os: Os) -> bool {
        self.platforms.contains(&os)
    }

    /// The file extension of this target's code objects, `None` for CPU targets.
    pub fn code_object_extension(&self) -> Option<&'static str> {
        match self.kind {
            Kind::Cpu => None,
            Kind::Amdgpu => Some("hsaco"),
            Kind::Nvidia => Some("cubin"),
        }
    }
}

/// Which targets a command acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    Target(String),
    Family(String),
    All,
}

/// The validated target matrix.
#[derive(Debug, Clone)]
pub struct Targets {
    pub path: PathBuf,
    pub rocm: Vec<RocmRelease>,
    pub cuda: Option<Cuda>,
    pub platforms: BTreeMap<Os, Platform>,
    pub families: Vec<Family>,
    /// In file order.
    pub targets: Vec<Target>,
}

impl Targets {
    /// Looks a target up by name; the error lists the known names.
    pub fn target(&self, name: &str) -> Result<&Target> {
        self.targets
            .iter()
            .find(|target| target.name == name)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "unknown target `{name}`: expected one of {} (from {})",
                    self.targets
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.path.display()
                )
            })
    }

    /// The targets of one family, in file order; the error lists the known families.
    pub fn family_members(&self, family: &str) -> Result<Vec<&Target>> {
        if !self.families.iter().any(|f| f.name == family) {
            anyhow::bail!(
                "unknown family `{family}`: expected one of {} (from {})",
                self.families
                    .iter()
                    .map(|f| f.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                self.path.display()
            );
        }
        Ok(self.targets.iter().filter(|t| t.family == family).collect())
    }

    pub fn select(&self, selection: &Selection) -> Result<Vec<&Target>> {
        match selection {
            Selection::Target(name) => Ok(vec![self.target(name)?]),
            Selection::Family(family) => self.family_members(family),
            Selection::All => Ok(self.targets.iter().collect()),
        }
    }

    /// The ROCm release builds use unless told otherwise.
    pub fn default_rocm(&self) -> &RocmRelease {
        // Validation guarantees exactly one default.
        self.rocm
            .iter()
            .find(|r| r.default)
            .unwrap_or(&self.rocm[0])
    }

    pub fn platform(&self, os: Os) -> Result<&Platform> {
        self.platforms
            .get(&os)
            .ok_or_else(|| anyhow::anyhow!("{} has no [platform.{os}] table", self.path.display()))
    }

    /// The image a target's container ships on when no `--base` is given.
    pub fn default_base_image(&self, target: &Target) -> Result<Image> {
        match target.kind {
            Kind::Amdgpu => Ok(self.default_rocm().runtime_image.clone()),
            Kind::Cpu => self
                .platform(Os::Linux)?
                .cpu_runtime_image
                .clone()
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}: [platform.linux] has no cpu_runtime_image for target `{}`",
                        self.path.display(),
                        target.name
                    )
                }),
            Kind::Nvidia => anyhow::bail!(
                "target `{}` is an NVIDIA target: ember builds no container images for it yet",
                target.name
            ),
        }
    }

    /// Parses and validates the text of a targets file; `path` is used in messages only.
    pub fn parse(text: &str, path: &Path) -> std::result::Result<Targets, TargetsError> {
        let lines = LineIndex::new(text);
        let raw: RawFile = toml::from_str(text).map_err(|error| TargetsError {
            problems: vec![Problem {
                path: path.to_path_buf(),
                line: error.span().map(|span| lines.line(span.start)),
                message: error.message().trim_end_matches('.').to_string(),
            }],
        })?;
        let mut validator = Validator {
            path,
            lines: &lines,
            problems: Vec::new(),
        };
        let targets = validator.validate(raw);
        if validator.problems.is_empty() {
            Ok(targets)
        } else {
            Err(TargetsError {
                problems: validator.problems,
            })
        }
    }
}

/// Byte offset to 1-based line number.
struct LineIndex {
    newlines: Vec<usize>,
}

impl LineIndex {
    fn new(text: &str) -> LineIndex {
        LineIndex {
            newlines: text.match_indices('\n').map(|(at, _)| at).collect(),
        }
    }

    fn line(&self, offset: usize) -> usize {
        self.newlines.partition_point(|&at| at < offset) + 1
    }
}

// The raw file as serde reads it. Spans are kept where a validation message needs a line.

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    schema: Spanned<u32>,
    #[serde(default)]
    rocm: Vec<Spanned<RawRocm>>,
    cuda: Option<Spanned<RawCuda>>,
    #[serde(default)]
    platform: BTreeMap<String, Spanned<RawPlatform>>,
    #[serde(default)]
    family: BTreeMap<String, Spanned<RawFamily>>,
    #[serde(default)]
    target: Vec<Spanned<RawTarget>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRocm {
    version: String,
    #[serde(default)]
    default: bool,
    build_image: String,
    #[serde(default)]
    build_image_digest: String,
    runtime_image: String,
    #[serde(default)]
    runtime_image_digest: String,
    windows_hip_sdk: Option<String>,
    windows_hip_sdk_installer: Option<String>,
    hip_runtime_dll: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCuda {
    version: String,
    build_image: String,
    #[serde(default)]
    build_image_digest: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlatform {
    runner: String,
    archive: String,
    rust_target: String,
    #[serde(default)]
    hip_runtime_libs: Vec<String>,
    cpu_runtime_image: Option<String>,
    #[serde(default)]
    cpu_runtime_image_digest: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFamily {
    kind: Kind,
    description: String,
    wave_size: Option<Spanned<u32>>,
    flash_attention: Option<Spanned<FlashAttention>>,
    platforms: Vec<Spanned<String>>,
    #[serde(default)]
    features: BTreeMap<String, Spanned<RawFeature>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    name: Spanned<String>,
    family: Spanned<String>,
    wave_size: Option<Spanned<u32>>,
    flash_attention: Option<Spanned<FlashAttention>>,
    platforms: Option<Vec<Spanned<String>>>,
    #[serde(default)]
    features: BTreeMap<String, Spanned<RawFeature>>,
    min_llvm: Option<Spanned<u32>>,
    #[serde(default)]
    runner: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFeature {
    state: FeatureState,
    reason: Option<String>,
    #[serde(default)]
    tracking: Vec<String>,
}

struct Validator<'a> {
    path: &'a Path,
    lines: &'a LineIndex,
    problems: Vec<Problem>,
}

impl Validator<'_> {
    fn problem(&mut self, span: Range<usize>, message: String) {
        let line = Some(self.lines.line(span.start));
        self.problems.push(Problem {
            path: self.path.to_path_buf(),
            line,
            message,
        });
    }

    fn validate(&mut self, raw: RawFile) -> Targets {
        if *raw.schema.get_ref() != SCHEMA {
            self.problem(
                raw.schema.span(),
                format!(
                    "expected schema = {SCHEMA}, found schema = {}",
                    raw.schema.get_ref()
                ),
            );
        }
        let rocm = self.validate_rocm(&raw.rocm);
        let cuda = raw.cuda.map(|cuda| {
            let cuda = cuda.into_inner();
            Cuda {
                version: cuda.version,
                build_image: image(cuda.build_image, cuda.build_image_digest),
            }
        });
        let platforms = self.validate_platforms(raw.platform);
        // The Windows engine must know the HIP runtime DLL of every release it is built for.
        if let Some(windows) = platforms.get(&Os::Windows) {
            for entry in &raw.rocm {
                let release = entry.get_ref();
                if let Some(dll) = &release.hip_runtime_dll {
                    if !windows.hip_runtime_libs.contains(dll) {
                        self.problem(
                            entry.span(),
                            format!(
                                "ROCm release `{}` ships {dll}, which [platform.windows] hip_runtime_libs does not list",
                                release.version
                            ),
                        );
                    }
                }
            }
        }
        let families = self.validate_families(&raw.family, &platforms);
        let targets = self.validate_targets(&raw.target, &raw.family, &platforms);
        if cuda.is_none() && targets.iter().any(|t| t.kind == Kind::Nvidia) {
            self.problems.push(Problem {
                path: self.path.to_path_buf(),
                line: None,
                message:
                    "NVIDIA targets are listed but there is no [cuda] table to build them with"
                        .to_string(),
            });
        }
        Targets {
            path: self.path.to_path_buf(),
            rocm,
            cuda,
            platforms,
            families,
            targets,
        }
    }

    fn validate_rocm(&mut self, raw: &[Spanned<RawRocm>]) -> Vec<RocmRelease> {
        if raw.is_empty() {
            self.problems.push(Problem {
                path: self.path.to_path_buf(),
                line: None,
                message: "expected at least one [[rocm]] release, found none".to_string(),
            });
        }
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        let mut releases = Vec::new();
        for entry in raw {
            let release = entry.get_ref();
            let line = self.lines.line(entry.span().start);
            if let Some(first) = seen.insert(&release.version, line) {
                self.problem(
                    entry.span(),
                    format!(
                        "duplicate ROCm release `{}` (first listed at line {first})",
                        release.version
                    ),
                );
            }
            for digest in [&release.build_image_digest, &release.runtime_image_digest] {
                if !digest.is_empty() && !is_sha256_digest(digest) {
                    self.problem(
                        entry.span(),
                        format!("expected an image digest like `sha256:<64 hex digits>`, found `{digest}`"),
                    );
                }
            }
            if release.windows_hip_sdk.is_some() != release.windows_hip_sdk_installer.is_some() {
                self.problem(
                    entry.span(),
                    format!(
                        "ROCm release `{}` must give windows_hip_sdk and windows_hip_sdk_installer together",
                        release.version
                    ),
                );
            }
            releases.push(RocmRelease {
                version: release.version.clone(),
                default: release.default,
                build_image: image(
                    release.build_image.clone(),
                    release.build_image_digest.clone(),
                ),
                runtime_image: image(
                    release.runtime_image.clone(),
                    release.runtime_image_digest.clone(),
                ),
                windows_hip_sdk: release.windows_hip_sdk.clone(),
                windows_hip_sdk_installer: release.windows_hip_sdk_installer.clone(),
                hip_runtime_dll: release.hip_runtime_dll.clone(),
            });
        }
        let defaults = raw.iter().filter(|r| r.get_ref().default).count();
        if !raw.is_empty() && defaults != 1 {
            let span = raw[0].span();
            self.problem(
                span,
                format!(
                    "expected exactly one [[rocm]] release with `default = true`, found {defaults}"
                ),
            );
        }
        releases
    }

    fn validate_platforms(
        &mut self,
        raw: BTreeMap<String, Spanned<RawPlatform>>,
    ) -> BTreeMap<Os, Platform> {
        let mut platforms = BTreeMap::new();
        for (name, entry) in raw {
            let span = entry.span();
            let Some(os) = parse_os(&name) else {
                self.problem(
                    span,
                    format!("unknown platform `{name}`: expected one of linux, windows"),
                );
                continue;
            };
            let platform = entry.into_inner();
            if platform.archive != "tar.gz" && platform.archive != "zip" {
                self.problem(
                    span.clone(),
                    format!(
                        "expected archive = \"tar.gz\" or \"zip\" for platform `{name}`, found `{}`",
                        platform.archive
                    ),
                );
            }
            if platform.cpu_runtime_image.is_none() && !platform.cpu_runtime_image_digest.is_empty()
            {
                self.problem(
                    span,
                    format!("platform `{name}` pins cpu_runtime_image_digest but names no cpu_runtime_image"),
                );
            }
            platforms.insert(
                os,
                Platform {
                    os,
                    runner: platform.runner,
                    archive: platform.archive,
                    rust_target: platform.rust_target,
                    hip_runtime_libs: platform.hip_runtime_libs,
                    cpu_runtime_image: platform
                        .cpu_runtime_image
                        .map(|tag| image(tag, platform.cpu_runtime_image_digest)),
                },
            );
        }
        for os in Os::ALL {
            if !platforms.contains_key(&os) {
                self.problems.push(Problem {
                    path: self.path.to_path_buf(),
                    line: None,
                    message: format!("expected a [platform.{os}] table, found none"),
                });
            }
        }
        platforms
    }

    fn validate_families(
        &mut self,
        raw: &BTreeMap<String, Spanned<RawFamily>>,
        platforms: &BTreeMap<Os, Platform>,
    ) -> Vec<Family> {
        let mut families = Vec::new();
        for (name, entry) in raw {
            let family = entry.get_ref();
            let context = format!("family `{name}`");
            self.check_platforms(&family.platforms, platforms, &context);
            self.check_features(&family.features, family.kind, &context);
            match family.kind {
                Kind::Cpu => {
                    for (present, field) in [
                        (family.wave_size.is_some(), "wave_size"),
                        (family.flash_attention.is_some(), "flash_attention"),
                    ] {
                        if present {
                            self.problem(
                                entry.span(),
                                format!("{context} is a CPU family but sets {field}, which only GPU families have"),
                            );
                        }
                    }
                }
                Kind::Amdgpu | Kind::Nvidia => {
                    for (missing, field) in [
                        (family.wave_size.is_none(), "wave_size"),
                        (family.flash_attention.is_none(), "flash_attention"),
                    ] {
                        if missing {
                            self.problem(
                                entry.span(),
                                format!("{context} is a GPU family but has no {field}"),
                            );
                        }
                    }
                }
            }
            families.push(Family {
                name: name.clone(),
                kind: family.kind,
                description: family.description.clone(),
            });
        }
        families
    }

    fn check_platforms(
        &mut self,
        raw: &[Spanned<String>],
        platforms: &BTreeMap<Os, Platform>,
        context: &str,
    ) -> Vec<Os> {
        let mut out = Vec::new();
        for entry in raw {
            match parse_os(entry.get_ref()) {
                Some(os) if platforms.contains_key(&os) || platforms.is_empty() => {
                    if out.contains(&os) {
                        self.problem(
                            entry.span(),
                            format!("{context} lists platform `{os}` twice"),
                        );
                    }
                    out.push(os);
                }
                _ => self.problem(
                    entry.span(),
                    format!(
                        "unknown platform `{}` in {context}: expected one of linux, windows",
                        entry.get_ref()
                    ),
                ),
            }
        }
        out
    }

    fn check_features(
        &mut self,
        raw: &BTreeMap<String, Spanned<RawFeature>>,
        kind: Kind,
        context: &str,
    ) {
        for (name, entry) in raw {
            let feature = entry.get_ref();
            let span = entry.span();
            if !KNOWN_FEATURES.contains(&name.as_str()) {
                self.problem(
                    span.clone(),
                    format!(
                        "unknown feature `{name}` in {context}: expected one of {}",
                        KNOWN_FEATURES.join(", ")
                    ),
                );
            }
            let reason = feature.reason.as_deref().map(str::trim).unwrap_or("");
            match feature.state {
                FeatureState::Off => {
                    if reason.is_empty() {
                        self.problem(
                            span.clone(),
                            format!("feature `{name}` of {context} is off but gives no reason"),
                        );
                    }
                    if feature.tracking.is_empty() {
                        self.problem(
                            span.clone(),
                            format!(
                                "feature `{name}` of {context} is off but has no tracking link"
                            ),
                        );
                    }
                }
                FeatureState::Unsupported => {
                    if reason.is_empty() {
                        self.problem(
                            span.clone(),
                            format!(
                                "feature `{name}` of {context} is unsupported but gives no reason"
                            ),
                        );
                    }
                    if !feature.tracking.is_empty() {
                        self.problem(
                            span.clone(),
                            format!(
                                "feature `{name}` of {context} is unsupported (the hardware has no such thing) yet has tracking links: did you mean state = \"off\""
                            ),
                        );
                    }
                }
                FeatureState::Probe => {
                    if name != "peer_copy" {
                        self.problem(
                            span.clone(),
                            format!("feature `{name}` of {context} is probe, but only peer_copy has a start-up self-test: expected on, off or unsupported"),
                        );
                    }
                    if reason.is_empty() {
                        self.problem(
                            span.clone(),
                            format!("feature `{name}` of {context} is probe but gives no reason"),
                        );
                    }
                    if kind == Kind::Cpu {
                        self.problem(
                            span.clone(),
                            format!("feature `{name}` of {context} is probe, but CPU targets have no GPU features"),
                        );
                    }
                }
                FeatureState::On => {
                    if kind == Kind::Cpu {
                        self.problem(
                            span.clone(),
                            format!("feature `{name}` of {context} is on, but CPU targets have no GPU features"),
                        );
                    }
                }
            }
            for link in &feature.tracking {
                if !link.starts_with("https://") {
                    self.problem(
                        span.clone(),
                        format!("expected a https:// tracking link for feature `{name}` of {context}, found `{link}`"),
                    );
                }
            }
        }
    }

    fn validate_targets(
        &mut self,
        raw: &[Spanned<RawTarget>],
        families: &BTreeMap<String, Spanned<RawFamily>>,
        platforms: &BTreeMap<Os, Platform>,
    ) -> Vec<Target> {
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut targets = Vec::new();
        for entry in raw {
            let raw_target = entry.get_ref();
            let name = raw_target.name.get_ref().clone();
            let name_span = raw_target.name.span();
            let line = self.lines.line(name_span.start);
            if let Some(first) = seen.insert(name.clone(), line) {
                self.problem(
                    name_span.clone(),
                    format!("duplicate target `{name}` (first defined at line {first})"),
                );
                continue;
            }
            let family_name = raw_target.family.get_ref();
            let Some(family_entry) = families.get(family_name) else {
                self.problem(
                    raw_target.family.span(),
                    format!(
                        "unknown family `{family_name}` for target `{name}`: expected one of {}",
                        families.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                );
                continue;
            };
            let family = family_entry.get_ref();
            let context = format!("target `{name}`");
            self.check_name(&name, family.kind, name_span.clone());
            self.check_features(&raw_target.features, family.kind, &context);

            let wave_size = raw_target.wave_size.as_ref().or(family.wave_size.as_ref());
            let flash_attention = raw_target
                .flash_attention
                .as_ref()
                .or(family.flash_attention.as_ref());
            if family.kind == Kind::Cpu {
                for (present, field) in [
                    (raw_target.wave_size.is_some(), "wave_size"),
                    (raw_target.flash_attention.is_some(), "flash_attention"),
                ] {
                    if present {
                        self.problem(
                            name_span.clone(),
                            format!("{context} is a CPU target but sets {field}, which only GPU targets have"),
                        );
                    }
                }
            }
            if let Some(wave_size) = wave_size {
                self.check_wave_size(&name, family.kind, wave_size);
            }
            if let (Some(flavour), Some(wave_size)) = (flash_attention, wave_size) {
                self.check_flash_attention(
                    &name,
                    *flavour.get_ref(),
                    *wave_size.get_ref(),
                    flavour.span(),
                );
            }
            if let Some(min_llvm) = &raw_target.min_llvm {
                if family.kind != Kind::Amdgpu {
                    self.problem(
                        min_llvm.span(),
                        format!("{context} sets min_llvm, which only AMDGPU targets (compiled by LLVM) use"),
                    );
                }
            }
            if !raw_target.runner.is_empty()
                && !raw_target.runner.iter().any(|l| l == "self-hosted")
            {
                self.problem(
                    name_span.clone(),
                    format!("{context} names runner labels {:?} without `self-hosted`: GPU smoke tests need a self-hosted runner", raw_target.runner),
                );
            }

            // The family's own list was checked (and any problem reported) with the family.
            let family_platforms: Vec<Os> = family
                .platforms
                .iter()
                .filter_map(|os| parse_os(os.get_ref()))
                .collect();
            let target_platforms = match &raw_target.platforms {
                Some(list) => {
                    let own = self.check_platforms(list, platforms, &context);
                    for os in &own {
                        if !family_platforms.contains(os) {
                            self.problem(
                                name_span.clone(),
                                format!("{context} lists platform `{os}`, which its family `{family_name}` does not support"),
                            );
                        }
                    }
                    own
                }
                None => family_platforms,
            };
            if target_platforms.is_empty() {
                self.problem(name_span.clone(), format!("{context} has no platforms"));
            }

            let mut features: BTreeMap<String, Feature> = BTreeMap::new();
            for (feature_name, feature) in family.features.iter().chain(raw_target.features.iter())
            {
                let feature = feature.get_ref();
                features.insert(
                    feature_name.clone(),
                    Feature {
                        name: feature_name.clone(),
                        state: feature.state,
                        reason: feature.reason.clone(),
                        tracking: feature.tracking.clone(),
                    },
                );
            }

            targets.push(Target {
                name,
                family: family_name.clone(),
                family_description: family.description.clone(),
                kind: family.kind,
                wave_size: wave_size.map(|w| *w.get_ref()),
                flash_attention: flash_attention.map(|f| *f.get_ref()),
                platforms: target_platforms,
                features: features.into_values().collect(),
                min_llvm: raw_target.min_llvm.as_ref().map(|m| *m.get_ref()),
                runner: raw_target.runner.clone(),
                line,
            });
        }
        targets
    }

    fn check_name(&mut self, name: &str, kind: Kind, span: Range<usize>) {
        let valid = match kind {
            Kind::Cpu => name == "cpu",
            Kind::Amdgpu => name.strip_prefix("gfx").is_some_and(|rest| {
                !rest.is_empty() && rest.chars().all(|c| c.is_ascii_hexdigit())
            }),
            Kind::Nvidia => sm_version(name).is_some(),
        };
        if !valid {
            let expected = match kind {
                Kind::Cpu => "`cpu`",
                Kind::Amdgpu => "`gfx` followed by the architecture number (gfx1201)",
                Kind::Nvidia => "`sm_` followed by the compute capability (sm_90)",
            };
            self.problem(
                span,
                format!("target `{name}` is in a {kind} family, so its name must be {expected}"),
            );
        }
    }

    fn check_wave_size(&mut self, name: &str, kind: Kind, wave_size: &Spanned<u32>) {
        let value = *wave_size.get_ref();
        let problem = if value != 32 && value != 64 {
            Some(format!(
                "expected wave_size = 32 or 64 for target `{name}`, found {value}"
            ))
        } else if kind == Kind::Amdgpu && is_gcn(name) && value != 64 {
            Some(format!(
                "target `{name}` is GCN/CDNA (gfx9), which runs wave64 only, but wave_size = {value}"
            ))
        } else if kind == Kind::Nvidia && value != 32 {
            Some(format!(
                "target `{name}` is NVIDIA, whose warps are 32 wide, but wave_size = {value}"
            ))
        } else {
            None
        };
        if let Some(message) = problem {
            self.problem(wave_size.span(), message);
        }
    }

    fn check_flash_attention(
        &mut self,
        name: &str,
        flavour: FlashAttention,
        wave_size: u32,
        span: Range<usize>,
    ) {
        let problem = match flavour {
            FlashAttention::Wmma if !(name.starts_with("gfx11") || name.starts_with("gfx12")) => {
                Some("WMMA exists on RDNA3/RDNA4 (gfx11, gfx12) only")
            }
            FlashAttention::Wmma if wave_size != 32 => {
                Some("ember's WMMA kernels are written for wave32")
            }
            FlashAttention::Mfma if !is_gcn(name) || name == "gfx900" || name == "gfx906" => {
                Some("MFMA exists on CDNA (gfx908, gfx90a, gfx94x, gfx950) only")
            }
            FlashAttention::Mfma if wave_size != 64 => Some("MFMA needs wave64"),
            _ => None,
        };
        if let Some(why) = problem {
            self.problem(
                span,
                format!(
                    "target `{name}` (wave_size = {wave_size}) asks for flash_attention = \"{}\", but {why}",
                    flavour.name()
                ),
            );
        }
    }
}

fn image(tag: String, digest: String) -> Image {
    Image {
        tag,
        digest: if digest.is_empty() {
            None
        } else {
            Some(digest)
        },
    }
}

fn is_sha256_digest(digest: &str) -> bool {
    digest
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.chars().all(|c| c.is_ascii_hexdigit()))
}

fn parse_os(name: &str) -> Option<Os> {
    match name {
        "linux" => Some(Os::Linux),
        "windows" => Some(Os::Windows),
        _ => None,
    }
}

/// gfx9 targets (GCN and CDNA) are wave64-only.
fn is_gcn(name: &str) -> bool {
    name.strip_prefix("gfx9")
        .is_some_and(|rest| rest.len() == 2)
}

/// `sm_90` -> 90.
pub fn sm_version(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("sm_")?;
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed() -> Targets {
        load().expect("the committed targets.toml is valid")
    }

    /// A minimal valid file; tests append to or edit it to provoke one problem at a time.
    const MINIMAL: &str = r#"schema = 1

[[rocm]]
version = "7.0"
default = true
build_image = "rocm/dev-ubuntu-24.04:7.0-complete"
runtime_image = "rocm/dev-ubuntu-24.04:7.0"

[platform.linux]
runner = "ubuntu-24.04"
archive = "tar.gz"
rust_target = "x86_64-unknown-linux-gnu"

[platform.windows]
runner = "windows-2022"
archive = "zip"
rust_target = "x86_64-pc-windows-gnu"

[family.gfx120X]
kind = "amdgpu"
description = "RDNA4"
wave_size = 32
flash_attention = "wmma"
platforms = ["linux", "windows"]
features.vmm = { state = "on" }

[[target]]
name = "gfx1201"
family = "gfx120X"
"#;

    /// Parses `text` and returns its problems as `line: message` strings.
    fn problems(text: &str) -> Vec<String> {
        match Targets::parse(text, Path::new("targets.toml")) {
            Ok(_) => Vec::new(),
            Err(error) => error
                .problems
                .iter()
                .map(|p| match p.line {
                    Some(line) => format!("{line}: {}", p.message),
                    None => p.message.clone(),
                })
                .collect(),
        }
    }

    fn check_problem(text: &str, expected: &str) {
        let found = problems(text);
        assert!(
            found.iter().any(|p| p == expected),
            "expected the problem\n  {expected}\nfound\n  {}",
            found.join("\n  ")
        );
    }

    #[test]
    fn minimal_file_is_valid() {
        assert_eq!(problems(MINIMAL), Vec::<String>::new());
    }

    #[test]
    fn committed_file_is_valid_and_complete() {
        let targets = committed();
        for name in [
            "cpu", "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1030", "gfx1031", "gfx1032",
            "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152", "gfx1200",
            "gfx1201", "sm_80", "sm_90",
        ] {
            targets.target(name).unwrap();
        }
        assert_eq!(targets.default_rocm().version, "7.2.1");
        let releases: Vec<&str> = targets.rocm.iter().map(|r| r.version.as_str()).collect();
        assert!(releases.contains(&"6.4.1"), "{releases:?}");
    }

    #[test]
    fn family_expansion() {
        let targets = committed();
        let names = |family: &str| -> Vec<String> {
            targets
                .family_members(family)
                .unwrap()
                .iter()
                .map(|t| t.name.clone())
                .collect()
        };
        assert_eq!(names("gfx120X"), ["gfx1200", "gfx1201"]);
        assert_eq!(names("gfx115X"), ["gfx1150", "gfx1151", "gfx1152"]);
        assert_eq!(
            names("gfx110X"),
            ["gfx1100", "gfx1101", "gfx1102", "gfx1103"]
        );
        assert_eq!(names("gfx103X"), ["gfx1030", "gfx1031", "gfx1032"]);
        assert_eq!(names("cdna"), ["gfx908", "gfx90a", "gfx942", "gfx950"]);
        assert_eq!(names("sm"), ["sm_80", "sm_90"]);
        let error = targets.family_members("gfx130X").unwrap_err().to_string();
        assert!(
            error.starts_with("unknown family `gfx130X`: expected one of "),
            "{error}"
        );
        assert_eq!(
            targets.select(&Selection::All).unwrap().len(),
            targets.targets.len()
        );
    }

    #[test]
    fn unknown_target_names_the_target() {
        let error = committed().target("gfx1250").unwrap_err().to_string();
        assert!(
            error.starts_with("unknown target `gfx1250`: expected one of cpu, gfx908"),
            "{error}"
        );
    }

    #[test]
    fn gating_vmm_off_on_gfx120x_with_reason_on_gfx1151() {
        let targets = committed();
        for name in ["gfx1200", "gfx1201"] {
            let vmm = targets.target(name).unwrap().feature("vmm").unwrap();
            assert_eq!(vmm.state, FeatureState::Off, "{name}");
            assert!(
                vmm.reason.as_deref().unwrap().contains("hipMemSetAccess"),
                "{name}"
            );
            assert_eq!(
                vmm.tracking,
                [
                    "https://github.com/ROCm/rocm-systems/issues/2516",
                    "https://github.com/ggml-org/llama.cpp/issues/18650"
                ]
            );
        }
        let vmm = targets.target("gfx1151").unwrap().feature("vmm").unwrap();
        assert_eq!(vmm.state, FeatureState::On);
        assert!(vmm.tracking.is_empty());
    }

    #[test]
    fn flash_attention_flavours_follow_the_architecture() {
        let targets = committed();
        let flavour = |name: &str| targets.target(name).unwrap().flash_attention;
        assert_eq!(flavour("gfx1100"), Some(FlashAttention::Wmma));
        assert_eq!(flavour("gfx1201"), Some(FlashAttention::Wmma));
        assert_eq!(flavour("gfx942"), Some(FlashAttention::Mfma));
        assert_eq!(flavour("gfx1030"), Some(FlashAttention::Tile));
        assert_eq!(flavour("cpu"), None);
        assert_eq!(targets.target("gfx90a").unwrap().wave_size, Some(64));
        assert_eq!(targets.target("gfx90a").unwrap().platforms, [Os::Linux]);
    }

    #[test]
    fn duplicate_target_names_both_lines() {
        let text = format!("{MINIMAL}\n[[target]]\nname = \"gfx1201\"\nfamily = \"gfx120X\"\n");
        check_problem(
            &text,
            "32: duplicate target `gfx1201` (first defined at line 28)",
        );
    }

    #[test]
    fn unknown_family_is_reported_at_its_line() {
        let text = format!("{MINIMAL}\n[[target]]\nname = \"gfx1200\"\nfamily = \"gfx12X\"\n");
        check_problem(
            &text,
            "33: unknown family `gfx12X` for target `gfx1200`: expected one of gfx120X",
        );
    }

    #[test]
    fn unknown_keys_and_values_are_rejected_with_lines() {
        let text = MINIMAL.replace("wave_size = 32", "wave_size = 32\nwavesize = 64");
        let found = problems(&text);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("23: unknown field `wavesize`"),
            "{found:?}"
        );

        let text = MINIMAL.replace(
            "features.vmm = { state = \"on\" }",
            "features.vmm = { state = \"maybe\" }",
        );
        let found = problems(&text);
        assert!(
            found[0].starts_with("25: unknown variant `maybe`"),
            "{found:?}"
        );

        let text = MINIMAL.replace("features.vmm", "features.vmn");
        check_problem(
            &text,
            "25: unknown feature `vmn` in family `gfx120X`: expected one of peer_copy, vmm",
        );
    }

    #[test]
    fn probe_is_for_peer_copy_and_needs_a_reason() {
        let text = MINIMAL.replace(
            "features.vmm = { state = \"on\" }",
            "features.vmm = { state = \"probe\", reason = \"a self-test\" }",
        );
        check_problem(
            &text,
            "25: feature `vmm` of family `gfx120X` is probe, but only peer_copy has a start-up self-test: expected on, off or unsupported",
        );
        let text = MINIMAL.replace(
            "features.vmm = { state = \"on\" }",
            "features.peer_copy = { state = \"probe\" }",
        );
        check_problem(
            &text,
            "25: feature `peer_copy` of family `gfx120X` is probe but gives no reason",
        );
        let text = MINIMAL.replace(
            "features.vmm = { state = \"on\" }",
            "features.peer_copy = { state = \"probe\", reason = \"corrupts on some boards\" }",
        );
        assert_eq!(problems(&text), Vec::<String>::new());
    }

    #[test]
    fn unknown_platform_is_reported_once() {
        let text = MINIMAL.replace(
            r#"platforms = ["linux", "windows"]"#,
            r#"platforms = ["linux", "macos"]"#,
        );
        assert_eq!(
            problems(&text),
            ["24: unknown platform `macos` in family `gfx120X`: expected one of linux, windows"]
        );
    }

    #[test]
    fn off_features_need_a_reason_and_a_tracking_link() {
        let text = MINIMAL.replace("{ state = \"on\" }", "{ state = \"off\" }");
        check_problem(
            &text,
            "25: feature `vmm` of family `gfx120X` is off but gives no reason",
        );
        check_problem(
            &text,
            "25: feature `vmm` of family `gfx120X` is off but has no tracking link",
        );
        let text = MINIMAL.replace(
            "{ state = \"on\" }",
            "{ state = \"off\", reason = \"faults\", tracking = [\"github.com/x/y/issues/1\"] }",
        );
        check_problem(
            &text,
            "25: expected a https:// tracking link for feature `vmm` of family `gfx120X`, found `github.com/x/y/issues/1`",
        );
    }

    #[test]
    fn contradictory_settings_are_rejected() {
        // WMMA on a wave64 CDNA part.
        let text = format!(
            "{MINIMAL}\n[family.cdna]\nkind = \"amdgpu\"\ndescription = \"CDNA\"\nwave_size = 64\nflash_attention = \"wmma\"\nplatforms = [\"linux\"]\n\n[[target]]\nname = \"gfx942\"\nfamily = \"cdna\"\n"
        );
        check_problem(
            &text,
            "35: target `gfx942` (wave_size = 64) asks for flash_attention = \"wmma\", but WMMA exists on RDNA3/RDNA4 (gfx11, gfx12) only",
        );
        // Wave32 on a wave64-only architecture, set on the target itself.
        let text = format!(
            "{MINIMAL}\n[family.cdna]\nkind = \"amdgpu\"\ndescription = \"CDNA\"\nwave_size = 64\nflash_attention = \"mfma\"\nplatforms = [\"linux\"]\n\n[[target]]\nname = \"gfx90a\"\nfamily = \"cdna\"\nwave_size = 32\n"
        );
        check_problem(
            &text,
            "41: target `gfx90a` is GCN/CDNA (gfx9), which runs wave64 only, but wave_size = 32",
        );
        // A Windows build of a Linux-only family.
        let text = format!(
            "{MINIMAL}\n[family.cdna]\nkind = \"amdgpu\"\ndescription = \"CDNA\"\nwave_size = 64\nflash_attention = \"mfma\"\nplatforms = [\"linux\"]\n\n[[target]]\nname = \"gfx90a\"\nfamily = \"cdna\"\nplatforms = [\"windows\"]\n"
        );
        check_problem(
            &text,
            "39: target `gfx90a` lists platform `windows`, which its family `cdna` does not support",
        );
        // A GPU feature switched on for the CPU.
        let text = format!(
            "{MINIMAL}\n[family.cpu]\nkind = \"cpu\"\ndescription = \"CPU\"\nplatforms = [\"linux\"]\nfeatures.vmm = {{ state = \"on\" }}\n\n[[target]]\nname = \"cpu\"\nfamily = \"cpu\"\n"
        );
        check_problem(
            &text,
            "35: feature `vmm` of family `cpu` is on, but CPU targets have no GPU features",
        );
        // A target name that does not fit its family's kind.
        let text = format!("{MINIMAL}\n[[target]]\nname = \"sm_90\"\nfamily = \"gfx120X\"\n");
        check_problem(
            &text,
            "32: target `sm_90` is in a amdgpu family, so its name must be `gfx` followed by the architecture number (gfx1201)",
        );
        // Two default ROCm releases.
        let text = MINIMAL.replace(
            "[platform.linux]",
            "[[rocm]]\nversion = \"6.4.1\"\ndefault = true\nbuild_image = \"a\"\nruntime_image = \"b\"\n\n[platform.linux]",
        );
        check_problem(
            &text,
            "3: expected exactly one [[rocm]] release with `default = true`, found 2",
        );
    }

    #[test]
    fn windows_must_know_every_hip_runtime_dll() {
        let text = MINIMAL
            .replace("runtime_image = \"rocm/dev-ubuntu-24.04:7.0\"", "runtime_image = \"rocm/dev-ubuntu-24.04:7.0\"\nhip_runtime_dll = \"amdhip64_7.dll\"")
            .replace("rust_target = \"x86_64-pc-windows-gnu\"", "rust_target = \"x86_64-pc-windows-gnu\"\nhip_runtime_libs = [\"amdhip64_6.dll\"]");
        check_problem(
            &text,
            "3: ROCm release `7.0` ships amdhip64_7.dll, which [platform.windows] hip_runtime_libs does not list",
        );
    }

    #[test]
    fn target_overrides_family_features() {
        let text = format!(
            "{MINIMAL}\n[[target]]\nname = \"gfx1200\"\nfamily = \"gfx120X\"\nfeatures.vmm = {{ state = \"off\", reason = \"faults\", tracking = [\"https://example.org/1\"] }}\n"
        );
        let targets = Targets::parse(&text, Path::new("t.toml")).unwrap();
        assert!(targets
            .target("gfx1201")
            .unwrap()
            .feature("vmm")
            .unwrap()
            .enabled());
        let vmm = targets.target("gfx1200").unwrap().feature("vmm").unwrap();
        assert_eq!(vmm.state, FeatureState::Off);
        assert_eq!(vmm.reason.as_deref(), Some("faults"));
    }

    #[test]
    fn errors_render_with_file_and_line() {
        let text = format!("{MINIMAL}\n[[target]]\nname = \"gfx1201\"\nfamily = \"gfx120X\"\n");
        let error = Targets::parse(&text, Path::new("targets.toml")).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid target matrix (1 problem):\n  targets.toml:32: duplicate target `gfx1201` (first defined at line 28)"
        );
    }

    #[test]
    fn images_resolve_to_digest_references_when_pinned() {
        let pinned = image("rocm/x:1".into(), format!("sha256:{}", "a".repeat(64)));
        assert_eq!(
            pinned.reference(),
            format!("rocm/x:1@sha256:{}", "a".repeat(64))
        );
        assert_eq!(
            image("rocm/x:1".into(), String::new()).reference(),
            "rocm/x:1"
        );
        let text = MINIMAL.replace(
            "runtime_image = \"rocm/dev-ubuntu-24.04:7.0\"",
            "runtime_image = \"rocm/dev-ubuntu-24.04:7.0\"\nruntime_image_digest = \"sha256:abc\"",
        );
        check_problem(
            &text,
            "3: expected an image digest like `sha256:<64 hex digits>`, found `sha256:abc`",
        );
    }

    #[test]
    fn sm_versions() {
        assert_eq!(sm_version("sm_90"), Some(90));
        assert_eq!(sm_version("sm_100"), Some(100));
        assert_eq!(sm_version("sm_"), None);
        assert_eq!(sm_version("gfx90a"), None);
    }
}
