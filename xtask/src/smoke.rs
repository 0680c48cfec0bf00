//! `cargo xtask smoke`: runs a packaged artifact or a container image against a real model and
//! checks what it reports, so a release is only cut from builds that were seen to work.
//!
//! The subject is one of: a Linux `.tar.gz` artifact (unpacked and run natively), a Windows `.zip`
//! artifact (run under wine with a private prefix in `target/`), or a container image (run with the
//! model cache mounted read-only at `/models`). Every subject goes through the same checks:
//!
//! - the package is intact (`SHA256SUMS`) and, for images, the image is built as documented
//!   (non-root user, health check, labels);
//! - `ember --version` names the version the artifact or image says it carries;
//! - `ember info --format json` shows the build manifest that `targets.toml` implies for the
//!   target: each feature's state, and the reason and tracking links of every feature that is off;
//! - `ember devices --format json` lists devices; where the target's GPU is absent it says so and
//!   the GPU checks are skipped, never silently;
//! - a real model from `models.toml` answers "The capital of France is" greedily with the ids of
//!   `tests/data/golden/greedy.jsonl`, by the rule of `tests/data/golden/README.md`;
//! - for images, the default command serves: `IMAGE -m /models/x.gguf` with port 8080 published
//!   answers `/health`, turns healthy by the image's HEALTHCHECK, answers a chat completion through
//!   the official `openai` Python client (`tests/server/smoke_chat.py`, in the venv of the server
//!   tests), serves `/metrics` with the vLLM-named series, and on SIGTERM finishes the stream it is
//!   serving, answers `/health` 503 meanwhile, and exits 0.
//!
//! All checks run even when one fails, so one run shows everything that is wrong.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use xshell::Shell;

use crate::docker::{self, ExpectedManifest};
use crate::targets::{self, FeatureState, Os};
use crate::wine;

mod http;

/// The prompt every smoke run answers; its reference output is in `greedy.jsonl`.
const SMOKE_PROMPT: &str = "The capital of France is";
/// How many tokens the smoke run generates and compares.
const SMOKE_TOKENS: usize = 16;
/// Where the image mounts the model cache (the Dockerfile's `EMBER_MODELS_DIR`).
const CONTAINER_MODELS_DIR: &str = "/models";
/// Where the Dockerfile puts the package.
const CONTAINER_EMBER_DIR: &str = "/opt/ember";

impl crate::flags::Smoke {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let root = crate::project_root();
        let started = Instant::now();
        let subject = match (&self.artifact, &self.image) {
            (Some(artifact), None) => Subject::from_artifact(sh, artifact)?,
            (None, Some(image)) => Subject::from_image(sh, image)?,
            _ => bail!("expected exactly one of --artifact PATH or --image TAG, found neither"),
        };
        println!(
            "smoke: {} (target {}, version {})",
            subject.description, subject.target, subject.version
        );

        let mut report = Report::default();
        for problem in &subject.package_problems {
            report.fail("package", problem);
        }
        if subject.package_problems.is_empty() {
            report.pass("package", &subject.package_summary);
        }

        let targets = targets::load()?;
        let expected = ExpectedManifest::of(targets.target(&subject.target)?);
        check_manifest_file(&mut report, &subject, &expected);
        check_version(&mut report, &subject);

        let model = ModelFile::find(&root, &self.model)?;
        check_info(&mut report, &subject, &expected, &model);
        check_devices(&mut report, &subject);
        check_generation(&mut report, &subject, &root, &model)?;
        if let Runner::Container { .. } = &subject.runner {
            check_serve(&mut report, sh, &root, &subject.runner, &model);
        }

        println!(
            "smoke: {} checks in {:.1} s",
            report.checks,
            started.elapsed().as_secs_f64()
        );
        if report.failures.is_empty() {
            println!("smoke: {} passed", subject.description);
            Ok(())
        } else {
            bail!(
                "smoke test of {} failed {} of {} checks:\n  {}",
                subject.description,
                report.failures.len(),
                report.checks,
                report.failures.join("\n  ")
            )
        }
    }
}

/// Results of the checks so far; printed as they come so a slow step shows where it is.
#[derive(Default)]
struct Report {
    checks: usize,
    failures: Vec<String>,
}

impl Report {
    fn pass(&mut self, check: &str, detail: &str) {
        self.checks += 1;
        println!("  ok    {check}: {detail}");
    }

    fn fail(&mut self, check: &str, detail: &str) {
        self.checks += 1;
        println!("  FAIL  {check}: {detail}");
        self.failures.push(format!("{check}: {detail}"));
    }

    /// A check that cannot run here (no such GPU); said out loud, never counted as passed.
    fn skip(&mut self, check: &str, detail: &str) {
        println!("  skip  {check}: {detail}");
    }
}

/// What is being smoke-tested and how to run its `ember`.
struct Subject {
    description: String,
    target: String,
    version: String,
    runner: Runner,
    /// `manifest.json` of the package, as text, or why it could not be read.
    manifest_json: Result<String, String>,
    package_summary: String,
    package_problems: Vec<String>,
    /// `info` takes the model on Windows (`ember.exe info -m <model>`), so that the wine run also
    /// proves the model file opens through wine's path mapping.
    info_takes_model: bool,
}

impl Subject {
    fn from_artifact(sh: &Shell, artifact: &Path) -> Result<Subject> {
        let file_name = artifact
            .file_name()
            .and_then(|name| name.to_str())
            .with_context(|| {
                format!(
                    "expected an artifact file path, found {}",
                    artifact.display()
                )
            })?;
        let name = ArtifactName::parse(file_name)?;
        let unpack_dir = crate::target_dir()
            .join("smoke")
            .join(file_name.trim_end_matches(name.extension()));
        if unpack_dir.exists() {
            std::fs::remove_dir_all(&unpack_dir).with_context(|| {
                format!("removing the previous unpack at {}", unpack_dir.display())
            })?;
        }
        std::fs::create_dir_all(&unpack_dir)?;
        // A `.sha256` beside the archive is checked when there is one: archives fetched from a
        // release come with it, a lone archive handed to the smoke test may not.
        let sums_path = artifact.with_file_name(format!("{file_name}.sha256"));
        let archive_checked = sums_path.is_file();
        if archive_checked {
            verify_archive_checksum(artifact, artifact)?;
        }
        match name.os {
            Os::Linux => unpack_tar_gz(artifact, &unpack_dir)?,
            Os::Windows => unpack_zip(artifact, &unpack_dir)?,
        }
        let binary_name = name.os.exe_name();
        let binary = find_file(&unpack_dir, binary_name, 3)?.with_context(|| {
            format!(
                "expected {binary_name} in {file_name}, found none (unpacked at {})",
                unpack_dir.display()
            )
        })?;
        let package_dir = binary.parent().unwrap_or(&unpack_dir).to_path_buf();
        let (package_summary, package_problems) = match verify_sha256sums(&package_dir) {
            Ok(count) => (
                format!(
                    "{}SHA256SUMS verified ({count} files)",
                    if archive_checked {
                        "archive checksum and "
                    } else {
                        ""
                    }
                ),
                Vec::new(),
            ),
            Err(problems) => (String::new(), problems),
        };
        let manifest_json =
            std::fs::read_to_string(package_dir.join("manifest.json")).map_err(|error| {
                format!("expected manifest.json next to {binary_name}, found an error: {error}")
            });
        let runner = match name.os {
            Os::Linux => Runner::Native { binary },
            Os::Windows => Runner::Wine {
                wine: wine::find_wine()?,
                binary,
                prefix: wine::prepare_prefix(sh)?,
            },
        };
        Ok(Subject {
            description: file_name.to_string(),
            target: name.target,
            version: name.version,
            runner,
            manifest_json,
            package_summary,
            package_problems,
            info_takes_model: name.os == Os::Windows,
        })
    }

    fn from_image(sh: &Shell, image: &str) -> Result<Subject> {
        let format = "{{json .Config}}";
        let config_json = xshell::cmd!(sh, "docker image inspect --format {format} {image}")
            .quiet()
            .read()
            .with_context(|| {
                format!("inspecting image {image} (is it built, and is dockerd running?)")
            })?;
        let config: ImageConfig = serde_json::from_str(&config_json)
            .with_context(|| format!("parsing `docker image inspect` of {image}"))?;
        let label = |key: &str| {
            config
                .labels
                .as_ref()
                .and_then(|labels| labels.get(key))
                .cloned()
        };
        let target = label(docker::LABEL_TARGET).with_context(|| {
            format!(
                "expected label {} on image {image}, found none",
                docker::LABEL_TARGET
            )
        })?;
        let version = label(docker::LABEL_VERSION).with_context(|| {
            format!(
                "expected label {} on image {image}, found none",
                docker::LABEL_VERSION
            )
        })?;
        let package_problems = check_image_config(&config);
        let runner = Runner::Container {
            image: image.to_string(),
            models_dir: models_dir()?,
        };
        let manifest_path = format!("{CONTAINER_EMBER_DIR}/manifest.json");
        let manifest_json = match run_capture(
            docker_run_base(&runner).args(["--entrypoint", "cat", image, &manifest_path]),
            Duration::from_secs(120),
        ) {
            Ok(output) if output.success() => Ok(output.stdout),
            Ok(output) => Err(format!(
                "expected {manifest_path} in the image, found none ({})",
                output.stderr_tail()
            )),
            Err(error) => Err(format!("{error:#}")),
        };
        Ok(Subject {
            description: format!("image {image}"),
            target,
            version,
            runner,
            manifest_json,
            package_summary:
                "non-root user, HEALTHCHECK, entrypoint, command, port and labels as documented"
                    .to_string(),
            package_problems,
            info_takes_model: false,
        })
    }
}

/// How to start the subject's `ember` with some arguments.
enum Runner {
    Native {
        binary: PathBuf,
    },
    Wine {
        wine: PathBuf,
        binary: PathBuf,
        prefix: PathBuf,
    },
    Container {
        image: String,
        models_dir: PathBuf,
    },
}

impl Runner {
    fn ember(&self, args: &[String]) -> Command {
        match self {
            Runner::Native { binary } => Command::new(binary.as_os_str()).args(args),
            Runner::Wine {
                wine,
                binary,
                prefix,
            } => Command::new(wine.as_os_str())
                .arg(binary.as_os_str())
                .args(args)
                .env("WINEPREFIX", prefix.as_os_str())
                .env("WINEDEBUG", "-all")
                // No Mono or Gecko: ember.exe needs neither, and their installers would stall
                // the first run on a fresh prefix.
                .env("WINEDLLOVERRIDES", "mscoree,mshtml="),
            Runner::Container { image, .. } => docker_run_base(self).arg(image.as_str()).args(args),
        }
    }

    /// The model's path as the subject's `ember` sees it.
    fn model_path(&self, model: &ModelFile) -> String {
        match self {
            Runner::Native { .. } => model.path.display().to_string(),
            // Wine maps the Unix root to drive Z:.
            Runner::Wine { .. } => format!("Z:{}", model.path.display()).replace('/', "\\"),
            Runner::Container { .. } => format!("{CONTAINER_MODELS_DIR}/{}", model.file),
        }
    }

    /// Slow first starts: wine creates its prefix on first use.
    fn timeout(&self, base: Duration) -> Duration {
        match self {
            Runner::Wine { .. } => base * 3,
            _ => base,
        }
    }
}

/// `docker run --rm` with the model cache mounted and, where this host has an AMD GPU stack, the
/// devices and options the image's run label documents.
fn docker_run_base(runner: &Runner) -> Command {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let name = format!(
        "ember-smoke-{}-{}",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::Relaxed)
    );
    let mut command = Command::new("docker").args(["run", "--rm", "--name", &name]);
    command.container = Some(name);
    if let Runner::Container { models_dir, .. } = runner {
        command = command.args([
            "-v".to_string(),
            format!("{}:{CONTAINER_MODELS_DIR}:ro", models_dir.display()),
        ]);
    }
    if Path::new("/dev/kfd").exists() && Path::new("/dev/dri").exists() {
        command = command.args(docker::GPU_RUN_ARGS);
    }
    command
}

/// A program with arguments and environment, run through duct so xtask holds the child and can
/// kill it when it hangs (a hung GPU must fail the smoke test, not stall CI).
struct Command {
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    env: Vec<(String, std::ffi::OsString)>,
    /// A container to kill when the command times out: killing the `docker run` client alone
    /// leaves the container running.
    container: Option<String>,
}

impl Command {
    fn new(program: impl Into<std::ffi::OsString>) -> Command {
        Command {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            container: None,
        }
    }

    fn arg(mut self, arg: impl Into<std::ffi::OsString>) -> Command {
        self.args.push(arg.into());
        self
    }

    fn args<I: IntoIterator<Item = S>, S: Into<std::ffi::OsString>>(mut self, args: I) -> Command {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    fn env(mut self, key: &str, value: impl Into<std::ffi::OsString>) -> Command {
        self.env.push((key.to_string(), value.into()));
        self
    }

    fn display(&self) -> String {
        std::iter::once(&self.program)
            .chain(&self.args)
            .map(|part| {
                let part = part.to_string_lossy();
                if part.contains(' ') || part.is_empty() {
                    format!("{part:?}")
                } else {
                    part.into_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }
}

struct CapturedOutput {
    status: Option<i32>,
    stdout: String,
    stderr: String,
}

impl CapturedOutput {
    fn success(&self) -> bool {
        self.status == Some(0)
    }

    /// The last lines of stderr, for failure messages.
    fn stderr_tail(&self) -> String {
        let lines: Vec<&str> = self
            .stderr
            .lines()
            .filter(|line| !line.trim().is_empty())
            .collect();
        let tail = &lines[lines.len().saturating_sub(6)..];
        if tail.is_empty() {
            "no stderr".to_string()
        } else {
            format!("stderr: {}", tail.join(" | "))
        }
    }
}

fn run_capture(command: Command, timeout: Duration) -> Result<CapturedOutput> {
    let display = command.display();
    let mut expression = duct::cmd(&command.program, &command.args);
    for (key, value) in &command.env {
        expression = expression.env(key, value);
    }
    let handle = expression
        .stdin_null()
        .stdout_capture()
        .stderr_capture()
        .unchecked()
        .start()
        .with_context(|| format!("starting {display}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(output) = handle
            .try_wait()
            .with_context(|| format!("waiting for {display}"))?
        {
            return Ok(CapturedOutput {
                status: output.status.code(),
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            });
        }
        if Instant::now() >= deadline {
            handle
                .kill()
                .with_context(|| format!("killing {display} after its timeout"))?;
            if let Some(container) = &command.container {
                // Best effort: the container may have exited between the check and the kill.
                let _ = duct::cmd!("docker", "kill", container)
                    .stdout_null()
                    .stderr_null()
                    .unchecked()
                    .run();
            }
            bail!(
                "expected {display} to finish within {} s, it was still running",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the subject's `ember` with `args`, printing the command line first.
fn run_ember(subject: &Subject, args: &[String], timeout: Duration) -> Result<CapturedOutput> {
    let command = subject.runner.ember(args);
    println!("  $ {}", command.display());
    let mut output = run_capture(command, subject.runner.timeout(timeout))?;
    // Wine exits with the low byte of the NTSTATUS when the loader fails, and prints nothing
    // under WINEDEBUG=-all; c0000135 is "DLL not found".
    if matches!(subject.runner, Runner::Wine { .. }) && output.status == Some(0x35) {
        output.stderr.push_str(
            "\nwine: ember.exe could not load a DLL it imports (status c0000135); \
             WINEDEBUG=err+module names it",
        );
    }
    Ok(output)
}

// ---------------------------------------------------------------------------------------------
// The checks.

fn check_manifest_file(report: &mut Report, subject: &Subject, expected: &ExpectedManifest) {
    let text = match &subject.manifest_json {
        Ok(text) => text,
        Err(problem) => return report.fail("manifest.json", problem),
    };
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(manifest) => {
            let problems = docker::compare_manifest_json(expected, &manifest);
            if problems.is_empty() {
                report.pass(
                    "manifest.json",
                    &format!("matches targets.toml for {}", expected.target),
                );
            } else {
                report.fail("manifest.json", &problems.join("; "));
            }
        }
        Err(error) => report.fail(
            "manifest.json",
            &format!("expected JSON, found a parse error: {error}"),
        ),
    }
}

fn check_version(report: &mut Report, subject: &Subject) {
    match run_ember(subject, &["--version".to_string()], Duration::from_secs(60)) {
        Ok(output) if output.success() && output.stdout.contains(&subject.version) => {
            report.pass("--version", output.stdout.trim())
        }
        Ok(output) if output.success() => report.fail(
            "--version",
            &format!(
                "expected the version {}, found {:?}",
                subject.version,
                output.stdout.trim()
            ),
        ),
        Ok(output) => report.fail(
            "--version",
            &format!(
                "expected exit status 0, found {:?}; {}",
                output.status,
                output.stderr_tail()
            ),
        ),
        Err(error) => report.fail("--version", &format!("{error:#}")),
    }
}

fn check_info(
    report: &mut Report,
    subject: &Subject,
    expected: &ExpectedManifest,
    model: &ModelFile,
) {
    let mut args = vec![
        "info".to_string(),
        "--format".to_string(),
        "json".to_string(),
    ];
    if subject.info_takes_model {
        args.extend(["-m".to_string(), subject.runner.model_path(model)]);
    }
    match run_ember(subject, &args, Duration::from_secs(60)) {
        Ok(output) if output.success() => {
            let problems = match serde_json::from_str::<serde_json::Value>(&output.stdout) {
                Ok(info) => check_info_json(expected, &info),
                Err(error) => vec![format!(
                    "expected a JSON object from `ember info --format json`, found {error}: {}",
                    output.stdout.chars().take(200).collect::<String>()
                )],
            };
            if problems.is_empty() {
                let off: Vec<String> = expected
                    .features
                    .iter()
                    .filter(|feature| feature.state != FeatureState::On)
                    .map(|feature| format!("{} {}", feature.name, feature.state.name()))
                    .collect();
                report.pass(
                    "info",
                    &format!(
                        "shows target {} and its {} features as targets.toml says (not on: {})",
                        expected.target,
                        expected.features.len(),
                        if off.is_empty() {
                            "none".to_string()
                        } else {
                            off.join(", ")
                        }
                    ),
                );
            } else {
                report.fail("info", &problems.join("; "));
            }
        }
        Ok(output) => report.fail(
            "info",
            &format!(
                "expected exit status 0, found {:?}; {}",
                output.status,
                output.stderr_tail()
            ),
        ),
        Err(error) => report.fail("info", &format!("{error:#}")),
    }
}

/// The image's default command serves. Started as docker/README.md documents (`IMAGE -m
/// /models/x.gguf` with port 8080 published, here on a free loopback port of the host), the
/// container must answer `/health`, turn healthy by its own HEALTHCHECK, answer a chat completion
/// through the official `openai` Python client, serve `/metrics` with the series inference gateways
/// scrape, and on SIGTERM finish the stream it is serving, refuse new work, and exit 0.
fn check_serve(report: &mut Report, sh: &Shell, root: &Path, runner: &Runner, model: &ModelFile) {
    if !model.path.is_file() {
        return report.fail(
            "serve",
            &format!(
                "expected the model file {} (model {} of models.toml), found none; fetch the pinned models first",
                model.path.display(),
                model.name
            ),
        );
    }
    let container = match ServingContainer::start(runner, model) {
        Ok(container) => container,
        Err(error) => return report.fail("serve", &format!("{error:#}")),
    };
    let (address, waited) = match container.wait_until_serving(Duration::from_secs(300)) {
        Ok(serving) => serving,
        Err(problem) => return report.fail("serve", &problem),
    };
    report.pass(
        "serve",
        &format!(
            "`IMAGE -m {}` answers /health 200 on {address} after {:.1} s",
            runner.model_path(model),
            waited.as_secs_f64()
        ),
    );
    match wait_for_health(&container.name, Duration::from_secs(60)) {
        Ok(waited) => report.pass(
            "healthcheck",
            &format!(
                "Docker's HEALTHCHECK (/health) says healthy after {:.1} s",
                waited.as_secs_f64()
            ),
        ),
        Err(problem) => report.fail("healthcheck", &problem),
    }
    check_chat_through_openai(report, sh, root, address);
    check_health_and_metrics(report, address);
    check_drain(report, &container, address);
}

/// The port the image's server listens on inside the container (the Dockerfile's EXPOSE).
const CONTAINER_SERVER_PORT: u16 = 8080;
/// Where the Dockerfile installs its entrypoint script.
const CONTAINER_ENTRYPOINT: &str = "/usr/local/bin/ember-entrypoint";

/// A container running the image's default command, removed when dropped.
struct ServingContainer {
    name: String,
}

impl ServingContainer {
    fn start(runner: &Runner, model: &ModelFile) -> Result<ServingContainer> {
        let Runner::Container { image, models_dir } = runner else {
            bail!("expected a container image to serve from, found another kind of subject");
        };
        let name = format!("ember-smoke-serve-{}", std::process::id());
        // Not `--rm`: the exit status and the logs are read after the container has stopped.
        // The health interval is shortened so Docker's verdict comes in seconds.
        let mut command = Command::new("docker").args([
            "run".to_string(),
            "--detach".to_string(),
            "--name".to_string(),
            name.clone(),
            "--health-interval".to_string(),
            "1s".to_string(),
            "-p".to_string(),
            format!("127.0.0.1::{CONTAINER_SERVER_PORT}"),
            "-v".to_string(),
            format!("{}:{CONTAINER_MODELS_DIR}:ro", models_dir.display()),
        ]);
        if Path::new("/dev/kfd").exists() && Path::new("/dev/dri").exists() {
            command = command.args(docker::GPU_RUN_ARGS);
        }
        let command = command.args([image.clone(), "-m".to_string(), runner.model_path(model)]);
        println!("  $ {}", command.display());
        let container = ServingContainer { name };
        let output = run_capture(command, Duration::from_secs(120))?;
        if !output.success() {
            bail!(
                "expected the container to start, found exit status {:?}; {}",
                output.status,
                output.stderr_tail()
            );
        }
        Ok(container)
    }

    /// Waits until `/health` answers 200 on the published port, showing progress; returns the
    /// address and how long it took.
    fn wait_until_serving(&self, timeout: Duration) -> Result<(SocketAddr, Duration), String> {
        let started = Instant::now();
        let address = self
            .published_address()
            .map_err(|error| format!("{error:#}"))?;
        let mut last_progress = Instant::now();
        loop {
            let last_answer = match http::get(address, "/health", Duration::from_secs(5)) {
                Ok((200, _)) => return Ok((address, started.elapsed())),
                Ok((status, body)) => format!("{status} {}", truncate(body.trim(), 200)),
                Err(error) => format!("{error:#}"),
            };
            let state = self.state();
            if state != "running" {
                return Err(format!(
                    "expected the server to keep running, found the container {state} (exit status {}) before /health answered 200; last answer: {last_answer}; {}",
                    self.exit_status(),
                    self.logs_tail()
                ));
            }
            if started.elapsed() > timeout {
                return Err(format!(
                    "expected /health 200 within {} s, last answer: {last_answer}; {}",
                    timeout.as_secs(),
                    self.logs_tail()
                ));
            }
            if last_progress.elapsed() >= Duration::from_secs(5) {
                println!(
                    "        waiting for /health on {address}: {last_answer} ({:.0} s)",
                    started.elapsed().as_secs_f64()
                );
                last_progress = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The host address Docker published the server's port on (`docker port`).
    fn published_address(&self) -> Result<SocketAddr> {
        let port = format!("{CONTAINER_SERVER_PORT}/tcp");
        let output = run_capture(
            Command::new("docker").args(["port", self.name.as_str(), port.as_str()]),
            Duration::from_secs(30),
        )?;
        if !output.success() {
            bail!(
                "expected `docker port {} {port}` to name the published port, found exit status {:?}; {}",
                self.name,
                output.status,
                output.stderr_tail()
            );
        }
        // One line per published address; the loopback one was asked for.
        output
            .stdout
            .lines()
            .find_map(|line| line.trim().parse::<SocketAddr>().ok())
            .with_context(|| {
                format!(
                    "expected `docker port` to print HOST:PORT, found {:?}",
                    output.stdout.trim()
                )
            })
    }

    fn inspect(&self, format: &str) -> String {
        run_capture(
            Command::new("docker").args(["inspect", "--format", format, self.name.as_str()]),
            Duration::from_secs(30),
        )
        .map(|output| output.stdout.trim().to_string())
        .unwrap_or_else(|error| format!("unknown ({error:#})"))
    }

    fn state(&self) -> String {
        self.inspect("{{.State.Status}}")
    }

    fn exit_status(&self) -> String {
        self.inspect("{{.State.ExitCode}}")
    }

    /// The container's last lines of output, for failure messages.
    fn logs_tail(&self) -> String {
        match run_capture(
            Command::new("docker").args(["logs", "--tail", "20", self.name.as_str()]),
            Duration::from_secs(30),
        ) {
            Ok(output) => {
                let lines: Vec<&str> = output
                    .stdout
                    .lines()
                    .chain(output.stderr.lines())
                    .filter(|line| !line.trim().is_empty())
                    .collect();
                format!("container logs: {}", lines.join(" | "))
            }
            Err(error) => format!("container logs unavailable: {error:#}"),
        }
    }
}

impl Drop for ServingContainer {
    fn drop(&mut self) {
        // Best effort: the container may not exist when `docker run` failed.
        let _ = duct::cmd!("docker", "rm", "--force", &self.name)
            .stdout_null()
            .stderr_null()
            .unchecked()
            .run();
    }
}

/// `tests/server/smoke_chat.py`: one chat completion through the pinned `openai` client, in the
/// venv that `cargo xtask test` uses for the server tests.
fn check_chat_through_openai(report: &mut Report, sh: &Shell, root: &Path, address: SocketAddr) {
    let python = match crate::test::server_test_python(sh, root) {
        Ok(python) => python,
        Err(error) => return report.fail("chat", &format!("{error:#}")),
    };
    let script = root.join("tests").join("server").join("smoke_chat.py");
    let command = Command::new(python.as_os_str()).args([
        script.as_os_str().to_owned(),
        address.ip().to_string().into(),
        address.port().to_string().into(),
    ]);
    println!("  $ {}", command.display());
    match run_capture(command, Duration::from_secs(300)) {
        Ok(output) if output.success() => {
            report.pass("chat", &format!("openai client: {}", output.stdout.trim()))
        }
        Ok(output) => report.fail(
            "chat",
            &format!(
                "expected smoke_chat.py to exit 0, found {:?}; {}",
                output.status,
                output.stderr_tail()
            ),
        ),
        Err(error) => report.fail("chat", &format!("{error:#}")),
    }
}

fn check_health_and_metrics(report: &mut Report, address: SocketAddr) {
    let timeout = Duration::from_secs(30);
    match http::get(address, "/health", timeout) {
        Ok((200, body)) => match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(health) if health["status"] == "ok" => {
                report.pass("health", "/health: 200 {\"status\":\"ok\"}")
            }
            _ => report.fail(
                "health",
                &format!("expected /health to answer {{\"status\":\"ok\"}}, found {body:?}"),
            ),
        },
        Ok((status, body)) => report.fail(
            "health",
            &format!(
                "expected /health 200, found {status} {}",
                truncate(&body, 200)
            ),
        ),
        Err(error) => report.fail("health", &format!("{error:#}")),
    }
    let series = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
    ];
    match http::get(address, "/metrics", timeout) {
        Ok((200, body)) => {
            let missing: Vec<&str> = series
                .iter()
                .copied()
                .filter(|name| !metric_has_sample(&body, name))
                .collect();
            if missing.is_empty() {
                report.pass(
                    "metrics",
                    &format!(
                        "/metrics: 200, {} lines, with {}",
                        body.lines().count(),
                        series.join(", ")
                    ),
                );
            } else {
                report.fail(
                    "metrics",
                    &format!(
                        "expected samples of {} in /metrics, found none",
                        missing.join(", ")
                    ),
                );
            }
        }
        Ok((status, body)) => report.fail(
            "metrics",
            &format!(
                "expected /metrics 200, found {status} {}",
                truncate(&body, 200)
            ),
        ),
        Err(error) => report.fail("metrics", &format!("{error:#}")),
    }
}

/// Whether Prometheus text has a sample line of the metric `name` (with or without labels).
fn metric_has_sample(text: &str, name: &str) -> bool {
    text.lines().any(|line| {
        line.strip_prefix(name).is_some_and(|rest| {
            (rest.starts_with('{') || rest.starts_with(' '))
                && rest
                    .rsplit(' ')
                    .next()
                    .is_some_and(|value| value.parse::<f64>().is_ok())
        })
    })
}

/// What the streaming request of the drain check saw, in order.
enum StreamEvent {
    Status(u16),
    Data(String),
    End,
    Failed(String),
}

/// SIGTERM while a stream is being served: the stream goes on to its end, `/health` says 503
/// meanwhile, and the container exits 0 (ember is PID 1: the entrypoint execs it).
fn check_drain(report: &mut Report, container: &ServingContainer, address: SocketAddr) {
    match drain_verdict(container, address) {
        Ok(summary) => report.pass("drain", &summary),
        Err(problem) => report.fail("drain", &format!("{problem}; {}", container.logs_tail())),
    }
}

fn drain_verdict(container: &ServingContainer, address: SocketAddr) -> Result<String, String> {
    let timeout = Duration::from_secs(120);
    let model = served_model(address).map_err(|error| format!("{error:#}"))?;
    // Counting goes on well past 128 tokens, so the stream is still running when SIGTERM comes.
    let body = serde_json::json!({
        "model": model,
        "prompt": "1, 2, 3, 4, 5,",
        "max_tokens": 128,
        "temperature": 0,
        "stream": true,
    })
    .to_string();
    let (sender, receiver) = std::sync::mpsc::channel();
    let streamer = std::thread::spawn(move || {
        let send = |event| sender.send(event).is_ok();
        let mut response =
            match http::request(address, "POST", "/v1/completions", Some(&body), timeout) {
                Ok(response) => response,
                Err(error) => return send(StreamEvent::Failed(format!("{error:#}"))),
            };
        if !send(StreamEvent::Status(response.status)) {
            return false;
        }
        let mut events = http::EventReader::default();
        loop {
            match response.next_piece() {
                Ok(Some(piece)) => {
                    for data in events.push(&piece) {
                        if !send(StreamEvent::Data(data)) {
                            return false;
                        }
                    }
                }
                Ok(None) => return send(StreamEvent::End),
                Err(error) => return send(StreamEvent::Failed(format!("{error:#}"))),
            }
        }
    });
    let next = |what: &str| {
        receiver.recv_timeout(timeout).map_err(|_| {
            format!(
                "expected {what} within {} s, found nothing",
                timeout.as_secs()
            )
        })
    };
    match next("the stream's status")? {
        StreamEvent::Status(200) => {}
        StreamEvent::Status(status) => {
            return Err(format!(
                "expected the streaming request to get 200, found {status}"
            ))
        }
        StreamEvent::Failed(error) => return Err(format!("streaming request: {error}")),
        StreamEvent::Data(_) | StreamEvent::End => {
            return Err("expected a status first".to_string())
        }
    }
    let mut chunks_before = 0;
    let mut chunks_after = 0;
    let mut done = false;
    let mut finish_reason = None;
    let mut record = |data: &str, after_signal: bool| {
        if data == "[DONE]" {
            done = true;
            return;
        }
        if after_signal {
            chunks_after += 1;
        } else {
            chunks_before += 1;
        }
        if let Ok(chunk) = serde_json::from_str::<serde_json::Value>(data) {
            if let Some(reason) = chunk["choices"][0]["finish_reason"].as_str() {
                finish_reason = Some(reason.to_string());
            }
        }
    };
    match next("the first chunk")? {
        StreamEvent::Data(data) => record(&data, false),
        StreamEvent::End => {
            return Err("expected chunks, found the stream ended without any".to_string())
        }
        StreamEvent::Failed(error) => return Err(format!("streaming request: {error}")),
        StreamEvent::Status(_) => return Err("expected one status".to_string()),
    }

    let kill = run_capture(
        Command::new("docker").args(["kill", "--signal", "TERM", container.name.as_str()]),
        Duration::from_secs(30),
    )
    .map_err(|error| format!("{error:#}"))?;
    if !kill.success() {
        return Err(format!(
            "`docker kill --signal TERM` failed: {}",
            kill.stderr_tail()
        ));
    }
    let health_while_draining = match http::get(address, "/health", Duration::from_secs(10)) {
        Ok((status, _)) => status,
        Err(error) => {
            return Err(format!(
                "expected /health to answer 503 while draining, found no answer: {error:#}"
            ))
        }
    };

    loop {
        match next("the rest of the stream after SIGTERM")? {
            StreamEvent::Data(data) => record(&data, true),
            StreamEvent::End => break,
            StreamEvent::Failed(error) => {
                return Err(format!(
                    "the stream broke after SIGTERM ({chunks_after} chunks after it): {error}"
                ))
            }
            StreamEvent::Status(_) => return Err("expected one status".to_string()),
        }
    }
    let _ = streamer.join();
    let waited = run_capture(
        Command::new("docker").args(["wait", container.name.as_str()]),
        timeout,
    )
    .map_err(|error| format!("{error:#}"))?;
    let exit_status = waited.stdout.trim().to_string();

    let mut problems = Vec::new();
    if health_while_draining != 503 {
        problems.push(format!(
            "expected /health 503 while draining, found {health_while_draining}"
        ));
    }
    if chunks_after == 0 {
        problems.push(format!(
            "expected the stream to go on after SIGTERM, found it had ended before ({chunks_before} chunks): nothing was drained"
        ));
    }
    if !done || finish_reason.is_none() {
        problems.push(format!(
            "expected the stream to end with a finish_reason and [DONE], found finish_reason {finish_reason:?}, [DONE] {done}"
        ));
    }
    if exit_status != "0" {
        problems.push(format!(
            "expected exit status 0 after the drain, found {exit_status:?}"
        ));
    }
    if problems.is_empty() {
        Ok(format!(
            "SIGTERM during a stream: {chunks_after} more chunks, finish_reason {}, [DONE]; /health 503 meanwhile; exit status 0",
            finish_reason.unwrap_or_default()
        ))
    } else {
        Err(problems.join("; "))
    }
}

/// The first model `/v1/models` lists.
fn served_model(address: SocketAddr) -> Result<String> {
    let (status, body) = http::get(address, "/v1/models", Duration::from_secs(30))?;
    if status != 200 {
        bail!(
            "expected /v1/models 200, found {status} {}",
            truncate(&body, 200)
        );
    }
    let models: serde_json::Value =
        serde_json::from_str(&body).with_context(|| format!("parsing /v1/models: {body:?}"))?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("expected /v1/models to list a model id, found {body:?}"))
}

fn wait_for_health(container: &str, timeout: Duration) -> Result<Duration, String> {
    let started = Instant::now();
    let format = "{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}";
    loop {
        let status = run_capture(
            Command::new("docker").args(["inspect", "--format", format, container]),
            Duration::from_secs(30),
        )
        .map_err(|error| format!("{error:#}"))?;
        match status.stdout.trim() {
            "healthy" => return Ok(started.elapsed()),
            "unhealthy" => {
                let log = run_capture(
                    Command::new("docker").args([
                        "inspect",
                        "--format",
                        "{{json .State.Health.Log}}",
                        container,
                    ]),
                    Duration::from_secs(30),
                )
                .map(|output| truncate(output.stdout.trim(), 400))
                .unwrap_or_default();
                return Err(format!(
                    "expected healthy, found unhealthy; health log {log}"
                ));
            }
            "none" => return Err("expected a HEALTHCHECK on the container, found none".to_string()),
            _ if started.elapsed() > timeout => {
                return Err(format!(
                    "expected healthy within {} s, found {:?}",
                    timeout.as_secs(),
                    status.stdout.trim()
                ))
            }
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

fn check_devices(report: &mut Report, subject: &Subject) {
    let args = ["devices", "--format", "json"].map(str::to_string);
    let output = match run_ember(subject, &args, Duration::from_secs(60)) {
        Ok(output) => output,
        Err(error) => return report.fail("devices", &format!("{error:#}")),
    };
    if !output.success() {
        return report.fail(
            "devices",
            &format!(
                "expected `ember devices` to list devices, found exit status {:?}; {}",
                output.status,
                output.stderr_tail()
            ),
        );
    }
    let listing = match serde_json::from_str::<serde_json::Value>(&output.stdout) {
        Ok(listing) => listing,
        Err(error) => {
            return report.fail(
                "devices",
                &format!(
                    "expected a JSON object from `ember devices --format json`, found {error}: {}",
                    output.stdout.chars().take(200).collect::<String>()
                ),
            )
        }
    };
    match devices_verdict(&subject.target, &listing) {
        DevicesVerdict::Listed(summary) => report.pass("devices", &summary),
        DevicesVerdict::GpuAbsent(arch) => {
            report.pass("devices", "CPU device listed");
            report.skip("gpu", &format!("no {arch} GPU here: GPU checks skipped"));
        }
        DevicesVerdict::Empty => report.fail(
            "devices",
            "expected the CPU in `ember devices --format json`, found no `cpu` object",
        ),
    }
}

fn check_generation(
    report: &mut Report,
    subject: &Subject,
    root: &Path,
    model: &ModelFile,
) -> Result<()> {
    if !model.path.is_file() {
        report.fail(
            "generate",
            &format!(
                "expected the model file {} (model {} of models.toml), found none; fetch the pinned models first",
                model.path.display(),
                model.name
            ),
        );
        return Ok(());
    }
    let golden = GoldenRun::find(
        &root.join("tests/data/golden/greedy.jsonl"),
        &model.name,
        SMOKE_PROMPT,
    )?;
    let args: Vec<String> = [
        "run",
        "-m",
        &subject.runner.model_path(model),
        "-p",
        SMOKE_PROMPT,
        "-n",
        &SMOKE_TOKENS.to_string(),
        "--temp",
        "0",
        "--format",
        "json",
    ]
    .iter()
    .map(|arg| arg.to_string())
    .collect();
    let output = match run_ember(subject, &args, Duration::from_secs(300)) {
        Ok(output) => output,
        Err(error) => {
            report.fail("generate", &format!("{error:#}"));
            return Ok(());
        }
    };
    if !output.success() {
        report.fail(
            "generate",
            &format!(
                "expected exit status 0, found {:?}; {}",
                output.status,
                output.stderr_tail()
            ),
        );
        return Ok(());
    }
    let generation = match RunJson::parse(&output.stdout) {
        Ok(generation) => generation,
        Err(error) => {
            report.fail("generate", &format!("{error:#}"));
            return Ok(());
        }
    };
    if generation.prompt_ids != golden.prompt_ids {
        report.fail(
            "generate",
            &format!(
                "expected prompt ids {:?}, found {:?}",
                golden.prompt_ids, generation.prompt_ids
            ),
        );
    }
    match compare_with_golden(&golden, &generation.tokens, SMOKE_TOKENS) {
        Ok(verdict) => report.pass(
            "generate",
            &format!("{verdict}; text {:?}", generation.text),
        ),
        Err(failure) => report.fail("generate", &failure.to_string()),
    }
    Ok(())
}

/// Image settings the Dockerfile promises, read back from `docker image inspect`.
#[derive(Debug, Deserialize)]
struct ImageConfig {
    #[serde(rename = "User", default)]
    user: String,
    #[serde(rename = "Healthcheck", default)]
    healthcheck: Option<serde_json::Value>,
    #[serde(rename = "Entrypoint", default)]
    entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    cmd: Option<Vec<String>>,
    #[serde(rename = "ExposedPorts", default)]
    exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
    #[serde(rename = "Labels", default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(rename = "Env", default)]
    env: Option<Vec<String>>,
}

fn check_image_config(config: &ImageConfig) -> Vec<String> {
    let mut problems = Vec::new();
    let user = config.user.split(':').next().unwrap_or_default();
    if user.is_empty() || user == "root" || user == "0" {
        problems.push(format!("expected a non-root USER, found {:?}", config.user));
    }
    if config
        .healthcheck
        .as_ref()
        .is_none_or(|healthcheck| healthcheck.is_null())
    {
        problems.push("expected a HEALTHCHECK, found none".to_string());
    }
    let expected_entrypoint = vec![CONTAINER_ENTRYPOINT.to_string()];
    if config.entrypoint.as_ref() != Some(&expected_entrypoint) {
        problems.push(format!(
            "expected entrypoint {expected_entrypoint:?}, found {:?}",
            config.entrypoint
        ));
    }
    let expected_cmd = vec!["serve".to_string()];
    if config.cmd.as_ref() != Some(&expected_cmd) {
        problems.push(format!(
            "expected the default command {expected_cmd:?}, found {:?}",
            config.cmd
        ));
    }
    let port = format!("{CONTAINER_SERVER_PORT}/tcp");
    if !config
        .exposed_ports
        .as_ref()
        .is_some_and(|ports| ports.contains_key(&port))
    {
        problems.push(format!(
            "expected the image to expose {port}, found {:?}",
            config
                .exposed_ports
                .as_ref()
                .map(|ports| ports.keys().collect::<Vec<_>>())
        ));
    }
    let models_env = format!("EMBER_MODELS_DIR={CONTAINER_MODELS_DIR}");
    if !config
        .env
        .iter()
        .flatten()
        .any(|entry| *entry == models_env)
    {
        problems.push(format!(
            "expected {models_env} in the image environment, found {:?}",
            config.env
        ));
    }
    let run_label = config
        .labels
        .as_ref()
        .and_then(|labels| labels.get(docker::LABEL_RUN));
    match run_label {
        Some(run) => {
            for arg in docker::GPU_RUN_ARGS.chunks(2) {
                let option = arg.join(" ");
                if !run.contains(&option) {
                    problems.push(format!(
                        "expected {option:?} in label {}, found {run:?}",
                        docker::LABEL_RUN
                    ));
                }
            }
        }
        None => problems.push(format!("expected label {}, found none", docker::LABEL_RUN)),
    }
    problems
}

// ---------------------------------------------------------------------------------------------
// Artifacts: names, unpacking, checksums.

/// `ember-<version>-<os>-<target>-x64.{tar.gz,zip}`, as `cargo xtask package` names archives.
#[derive(Debug, PartialEq, Eq)]
struct ArtifactName {
    version: String,
    os: Os,
    target: String,
}

impl ArtifactName {
    fn parse(file_name: &str) -> Result<ArtifactName> {
        let expected = "expected an artifact named ember-<version>-<os>-<target>-x64.tar.gz (linux) or .zip (windows)";
        let (stem, extension_os) = if let Some(stem) = file_name.strip_suffix("-x64.tar.gz") {
            (stem, Os::Linux)
        } else if let Some(stem) = file_name.strip_suffix("-x64.zip") {
            (stem, Os::Windows)
        } else {
            bail!("{expected}, found {file_name}");
        };
        let rest = stem
            .strip_prefix("ember-")
            .with_context(|| format!("{expected}, found {file_name}"))?;
        // Versions may carry '-' (0.2.0-rc.1); targets and OS names do not, so split from the right.
        let mut parts = rest.rsplitn(3, '-');
        let (Some(target), Some(os), Some(version)) = (parts.next(), parts.next(), parts.next())
        else {
            bail!("{expected}, found {file_name}");
        };
        let os = match os {
            "linux" => Os::Linux,
            "windows" => Os::Windows,
            other => bail!("{expected}, found OS {other:?} in {file_name}"),
        };
        if os != extension_os {
            bail!("{expected}, found a {os} artifact with the other OS's extension: {file_name}");
        }
        if version.is_empty() || target.is_empty() {
            bail!("{expected}, found {file_name}");
        }
        Ok(ArtifactName {
            version: version.to_string(),
            os,
            target: target.to_string(),
        })
    }

    fn extension(&self) -> &'static str {
        match self.os {
            Os::Linux => ".tar.gz",
            Os::Windows => ".zip",
        }
    }
}

pub(crate) fn unpack_tar_gz(archive: &Path, into: &Path) -> Result<()> {
    let file =
        std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    // `unpack` refuses entries that would land outside `into` (absolute paths, `..`).
    tar::Archive::new(flate2::read::GzDecoder::new(file))
        .unpack(into)
        .with_context(|| format!("unpacking {} into {}", archive.display(), into.display()))
}

pub(crate) fn unpack_zip(archive: &Path, into: &Path) -> Result<()> {
    let file =
        std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("reading {} as a zip", archive.display()))?;
    // `extract` skips nothing silently: names escaping `into` are an error.
    zip.extract(into)
        .with_context(|| format!("unpacking {} into {}", archive.display(), into.display()))
}

/// The first file called `name` at most `max_depth` folders below `dir`, breadth first.
fn find_file(dir: &Path, name: &str, max_depth: usize) -> Result<Option<PathBuf>> {
    let mut level = vec![dir.to_path_buf()];
    for _ in 0..=max_depth {
        let mut next = Vec::new();
        for folder in level {
            let mut entries: Vec<_> = std::fs::read_dir(&folder)
                .with_context(|| format!("listing {}", folder.display()))?
                .collect::<std::io::Result<_>>()?;
            entries.sort_by_key(|entry| entry.file_name());
            for entry in entries {
                let file_type = entry.file_type()?;
                if file_type.is_file() && entry.file_name() == name {
                    return Ok(Some(entry.path()));
                }
                if file_type.is_dir() {
                    next.push(entry.path());
                }
            }
        }
        level = next;
    }
    Ok(None)
}

/// One line of a `SHA256SUMS` file as `sha256sum` writes it: 64 hex digits, a space, a space or
/// `*` (binary mode), then the path.
fn parse_sha256sums(text: &str) -> Result<Vec<(String, String)>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let bad = || {
                format!(
                    "SHA256SUMS line {}: expected `<64 hex digits>  <path>`, found {line:?}",
                    index + 1
                )
            };
            let (digest, rest) = line.split_at_checked(64).ok_or_else(bad)?;
            if !digest.bytes().all(|byte| byte.is_ascii_hexdigit()) {
                return Err(bad());
            }
            let path = rest
                .strip_prefix("  ")
                .or_else(|| rest.strip_prefix(" *"))
                .ok_or_else(bad)?;
            if path.is_empty() {
                return Err(bad());
            }
            Ok((digest.to_ascii_lowercase(), path.to_string()))
        })
        .collect()
}

/// Checks every file that `dir/SHA256SUMS` lists; returns how many, or every problem found.
pub(crate) fn verify_sha256sums(dir: &Path) -> Result<usize, Vec<String>> {
    let text = std::fs::read_to_string(dir.join("SHA256SUMS")).map_err(|error| {
        vec![format!(
            "expected SHA256SUMS next to the binary, found an error: {error}"
        )]
    })?;
    check_sha256sums(&text, |path| sha256_file(&dir.join(path)))
}

/// Checks every file that the `SHA256SUMS` text lists, getting each one's SHA-256 (hex) from
/// `digest_of` (the path as listed); returns how many, or every problem found. `cargo xtask docker`
/// checks an artifact's files in memory with it.
pub(crate) fn check_sha256sums(
    text: &str,
    digest_of: impl Fn(&str) -> std::io::Result<String>,
) -> Result<usize, Vec<String>> {
    let entries = parse_sha256sums(text).map_err(|problem| vec![problem])?;
    if entries.is_empty() {
        return Err(vec![
            "expected SHA256SUMS to list files, found it empty".to_string()
        ]);
    }
    let mut problems = Vec::new();
    for (digest, path) in &entries {
        if Path::new(path).is_absolute() || path.split('/').any(|part| part == "..") {
            problems.push(format!(
                "expected a path inside the package in SHA256SUMS, found {path:?}"
            ));
            continue;
        }
        match digest_of(path) {
            Ok(actual) if actual == *digest => {}
            Ok(actual) => {
                problems.push(format!("{path}: expected SHA-256 {digest}, found {actual}"))
            }
            Err(error) => problems.push(format!(
                "{path}: listed in SHA256SUMS but unreadable: {error}"
            )),
        }
    }
    if problems.is_empty() {
        Ok(entries.len())
    } else {
        Err(problems)
    }
}

/// Checks `copy` (a copy of `archive`, or the archive itself) against the `<archive>.sha256` file
/// that `cargo xtask package` writes beside it, so an archive that was rewritten while it was read
/// (a concurrent build) or damaged in transfer is caught before anything runs from it.
pub fn verify_archive_checksum(archive: &Path, copy: &Path) -> Result<()> {
    let actual = sha256_file(copy).with_context(|| format!("reading {}", copy.display()))?;
    verify_archive_digest(archive, &actual)
}

/// Checks the SHA-256 (hex) of bytes read from `archive` against its `<archive>.sha256` file.
pub fn verify_archive_digest(archive: &Path, actual: &str) -> Result<()> {
    let file_name = archive
        .file_name()
        .and_then(|name| name.to_str())
        .with_context(|| format!("expected an archive file, found {}", archive.display()))?;
    let sums_path = archive.with_file_name(format!("{file_name}.sha256"));
    let text = std::fs::read_to_string(&sums_path).with_context(|| {
        format!(
            "reading {} (written by `cargo xtask package`)",
            sums_path.display()
        )
    })?;
    let entries = parse_sha256sums(&text).map_err(anyhow::Error::msg)?;
    let [(digest, listed)] = entries.as_slice() else {
        bail!(
            "expected one line in {}, found {}",
            sums_path.display(),
            entries.len()
        );
    };
    if listed != file_name {
        bail!(
            "expected {} to list {file_name}, found {listed}",
            sums_path.display()
        );
    }
    if actual != digest {
        bail!(
            "expected {file_name} to have SHA-256 {digest} (from {}), found {actual}: the archive is damaged or was rewritten while it was read; rebuild it",
            sums_path.display()
        );
    }
    Ok(())
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let read = file.read(&mut buffer)?;
        if read == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buffer[..read]);
    }
}

// ---------------------------------------------------------------------------------------------
// Models.

/// A pinned model of models.toml and where the fetch puts it.
pub(crate) struct ModelFile {
    name: String,
    file: String,
    pub(crate) path: PathBuf,
}

impl ModelFile {
    /// The model `name` of models.toml, in `$EMBER_MODELS_DIR` or `~/.cache/ember/models`.
    pub(crate) fn find(root: &Path, name: &str) -> Result<ModelFile> {
        #[derive(Deserialize)]
        struct ModelsToml {
            model: Vec<ModelEntry>,
        }
        #[derive(Deserialize)]
        struct ModelEntry {
            name: String,
            file: String,
        }
        let path = root.join("models.toml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let models: ModelsToml =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let known: Vec<&str> = models
            .model
            .iter()
            .map(|model| model.name.as_str())
            .collect();
        let entry = models
            .model
            .iter()
            .find(|model| model.name == name)
            .with_context(|| {
                format!(
                    "expected a model name from models.toml ({}), found {name:?}",
                    known.join(", ")
                )
            })?;
        if entry.file.contains('/') || entry.file.contains('\\') {
            bail!(
                "expected a bare file name for model {name} in models.toml, found {:?}",
                entry.file
            );
        }
        Ok(ModelFile {
            name: entry.name.clone(),
            file: entry.file.clone(),
            path: models_dir()?.join(&entry.file),
        })
    }
}

/// `EMBER_MODELS_DIR`, else `~/.cache/ember/models`: where the pinned models are fetched to.
fn models_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("EMBER_MODELS_DIR").filter(|dir| !dir.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .filter(|home| !home.is_empty())
        .context("expected EMBER_MODELS_DIR or HOME to locate the model cache, found neither")?;
    Ok(PathBuf::from(home).join(".cache/ember/models"))
}

// ---------------------------------------------------------------------------------------------
// `ember info` against the expected manifest.

/// Every way `ember info --format json` output disagrees with `expected`: the build manifest's
/// `target`, and for each expected feature its `state`, and for a feature that is off or
/// unsupported its `reason` and every tracking link.
fn check_info_json(expected: &ExpectedManifest, info: &serde_json::Value) -> Vec<String> {
    let mut problems = Vec::new();
    let build = &info["build"];
    match build["target"].as_str() {
        Some(target) if target == expected.target => {}
        found => problems.push(format!(
            "expected target {} in `ember info`, found {found:?}",
            expected.target
        )),
    }
    let shown: Vec<&serde_json::Value> = build["features"]
        .as_array()
        .map(|features| features.iter().collect())
        .unwrap_or_default();
    for feature in &expected.features {
        let state = feature.state.name();
        let Some(found) = shown
            .iter()
            .find(|f| f["name"].as_str() == Some(feature.name.as_str()))
        else {
            problems.push(format!(
                "expected feature {} ({state}) in `ember info`, found none",
                feature.name
            ));
            continue;
        };
        let found_state = found["state"].as_str().unwrap_or("");
        if found_state != state {
            problems.push(format!(
                "expected feature {} to be {state}, found {found_state:?}",
                feature.name
            ));
        }
        if let (Some(reason), false) = (&feature.reason, feature.state == FeatureState::On) {
            let found_reason = found["reason"].as_str();
            if found_reason != Some(reason.as_str()) {
                problems.push(format!(
                    "expected the reason {} is {state} (\"{reason}\") in `ember info`, found {found_reason:?}",
                    feature.name
                ));
            }
        }
        let links: Vec<&str> = found["tracking"]
            .as_array()
            .map(|links| links.iter().filter_map(|l| l.as_str()).collect())
            .unwrap_or_default();
        for link in feature
            .tracking
            .iter()
            .filter(|link| !links.contains(&link.as_str()))
        {
            problems.push(format!(
                "expected the tracking link {link} of feature {} in `ember info`, found it missing",
                feature.name
            ));
        }
    }
    problems
}

// ---------------------------------------------------------------------------------------------
// Devices.

#[derive(Debug, PartialEq, Eq)]
enum DevicesVerdict {
    /// The devices the target needs are there.
    Listed(String),
    /// A GPU target on a host without that GPU: the CPU checks still run.
    GpuAbsent(String),
    Empty,
}

/// What `ember devices --format json` means for `target`: the CPU target needs the CPU listed; a
/// GPU target (`gfx*`, `sm_*`) needs a device of exactly its architecture.
fn devices_verdict(target: &str, listing: &serde_json::Value) -> DevicesVerdict {
    let cpu = &listing["cpu"];
    if !cpu.is_object() {
        return DevicesVerdict::Empty;
    }
    let arch = target.to_lowercase();
    let is_gpu_target = arch.starts_with("gfx") || arch.starts_with("sm_");
    if !is_gpu_target {
        return DevicesVerdict::Listed(format!(
            "cpu {} ({} SIMD, {} physical cores)",
            cpu["arch"].as_str().unwrap_or("?"),
            cpu["simd"].as_str().unwrap_or("?"),
            cpu["physical_cores"]
        ));
    }
    let gpus: Vec<String> = listing["devices"]
        .as_array()
        .map(|devices| devices.as_slice())
        .unwrap_or_default()
        .iter()
        .filter(|d| d["arch"].as_str().map(str::to_lowercase).as_deref() == Some(arch.as_str()))
        .map(|d| {
            format!(
                "{} {} ({})",
                d["id"].as_str().unwrap_or("?"),
                d["name"].as_str().unwrap_or("?"),
                d["arch"].as_str().unwrap_or("?")
            )
        })
        .collect();
    if gpus.is_empty() {
        DevicesVerdict::GpuAbsent(target.to_string())
    } else {
        DevicesVerdict::Listed(format!("{target} GPU listed: {}", gpus.join(" | ")))
    }
}

// ---------------------------------------------------------------------------------------------
// Greedy output against the llama.cpp reference.

/// One line of `tests/data/golden/greedy.jsonl`.
#[derive(Debug, Deserialize)]
struct GoldenRun {
    model: String,
    prompt: String,
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
    steps: Vec<GoldenStep>,
}

/// llama.cpp re-evaluating one step alone: its choice and the two most likely ids with their
/// log-probabilities.
#[derive(Debug, Deserialize)]
struct GoldenStep {
    id: u32,
    top: Vec<(u32, f64)>,
}

impl GoldenRun {
    fn find(path: &Path, model: &str, prompt: &str) -> Result<GoldenRun> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (index, line) in text
            .lines()
            .enumerate()
            .filter(|(_, line)| !line.trim().is_empty())
        {
            let run: GoldenRun = serde_json::from_str(line)
                .with_context(|| format!("parsing {} line {}", path.display(), index + 1))?;
            if run.model == model && run.prompt == prompt {
                return Ok(run);
            }
        }
        bail!(
            "expected a reference for model {model} and prompt {prompt:?} in {}, found none",
            path.display()
        )
    }
}

/// What `ember run --format json` prints.
#[derive(Debug, Deserialize)]
struct RunJson {
    prompt_ids: Vec<u32>,
    tokens: Vec<u32>,
    #[serde(default)]
    text: String,
}

impl RunJson {
    /// The last stdout line that is a JSON object: progress or log lines before it are allowed.
    fn parse(stdout: &str) -> Result<RunJson> {
        let line = stdout
            .lines()
            .rev()
            .map(str::trim)
            .find(|line| line.starts_with('{'))
            .with_context(|| {
                format!(
                    "expected a JSON object from `run --format json`, found {:?}",
                    truncate(stdout, 200)
                )
            })?;
        serde_json::from_str(line).with_context(|| {
            format!("expected {{\"prompt_ids\":[...],\"tokens\":[...],\"text\":\"...\"}} from `run --format json`, found {:?}", truncate(line, 200))
        })
    }
}

fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        text.to_string()
    } else {
        format!("{}...", text.chars().take(max_chars).collect::<String>())
    }
}

/// How a generation matched the reference.
#[derive(Debug, PartialEq)]
enum GoldenMatch {
    /// Every compared id equals the reference.
    Equal { compared: usize },
    /// The ids part at `step`, which the golden rule accepts for `why`; later ids are not compared.
    PartedAtUnstableStep { step: usize, why: UnstableWhy },
}

#[derive(Debug, PartialEq)]
enum UnstableWhy {
    /// llama.cpp's batched and one-token paths disagree at this step.
    ReferenceDisagreesWithItself,
    /// The implementation chose what llama.cpp's one-token path chose.
    ChoseSingleStepId,
    /// The top two probabilities are within 2% of each other.
    NearTie { ratio: f64 },
}

impl fmt::Display for GoldenMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GoldenMatch::Equal { compared } => write!(f, "all {compared} ids equal the reference"),
            GoldenMatch::PartedAtUnstableStep { step, why } => {
                write!(f, "equal to the reference up to step {step}, where it parts at an unstable step (")?;
                match why {
                    UnstableWhy::ReferenceDisagreesWithItself => {
                        write!(f, "llama.cpp disagrees with itself there")?
                    }
                    UnstableWhy::ChoseSingleStepId => {
                        write!(f, "chose llama.cpp's one-token choice")?
                    }
                    UnstableWhy::NearTie { ratio } => {
                        write!(f, "top two probabilities within 2%: ratio {ratio:.4}")?
                    }
                }
                write!(f, ")")
            }
        }
    }
}

#[derive(Debug, PartialEq)]
enum GoldenFailure {
    /// Parted from the reference at a step where llama.cpp is stable and the choice is clear.
    PartedAtStableStep {
        step: usize,
        expected: u32,
        found: u32,
        top: Vec<(u32, f64)>,
    },
    /// A different number of ids than requested (an early stop is a parting the rule cannot judge).
    WrongLength { expected: usize, found: usize },
    /// The reference has no step data where the ids part, so the rule cannot accept the parting.
    NoStepData { step: usize },
}

impl fmt::Display for GoldenFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GoldenFailure::PartedAtStableStep { step, expected, found, top } => write!(
                f,
                "expected id {expected} at step {step} (a stable step: llama.cpp agrees with itself and its top two are {top:?}), found {found}"
            ),
            GoldenFailure::WrongLength { expected, found } => {
                write!(f, "expected {expected} generated ids, found {found}")
            }
            GoldenFailure::NoStepData { step } => {
                write!(f, "ids part from the reference at step {step}, where the reference has no step data to judge it")
            }
        }
    }
}

/// The golden rule of `tests/data/golden/README.md`: the generated ids equal the reference up to
/// the first step k where they part, and at k either llama.cpp disagrees with itself, or the
/// generation chose llama.cpp's one-token id, or the top two probabilities are within 2% of each
/// other. Nothing after k is compared. `requested` is the `-n` the generation ran with.
fn compare_with_golden(
    golden: &GoldenRun,
    generated: &[u32],
    requested: usize,
) -> Result<GoldenMatch, GoldenFailure> {
    let compared = requested.min(golden.tokens.len());
    let parting = golden.tokens[..compared]
        .iter()
        .zip(generated)
        .position(|(expected, found)| expected != found);
    let Some(step) = parting else {
        // No parting within what both have: the lengths must agree too.
        if generated.len() != requested {
            return Err(GoldenFailure::WrongLength {
                expected: requested,
                found: generated.len(),
            });
        }
        return Ok(GoldenMatch::Equal { compared });
    };
    let found = generated[step];
    let expected = golden.tokens[step];
    let Some(reference_step) = golden.steps.get(step) else {
        return Err(GoldenFailure::NoStepData { step });
    };
    let why = if reference_step.id != expected {
        UnstableWhy::ReferenceDisagreesWithItself
    } else if found == reference_step.id {
        UnstableWhy::ChoseSingleStepId
    } else if let [(_, first), (_, second), ..] = reference_step.top.as_slice() {
        // Log-probabilities in, probabilities compared: within 2% means the smaller is at least
        // 98% of the larger.
        let (p1, p2) = (first.exp(), second.exp());
        let ratio = p1.min(p2) / p1.max(p2);
        if ratio >= 0.98 {
            UnstableWhy::NearTie { ratio }
        } else {
            return Err(GoldenFailure::PartedAtStableStep {
                step,
                expected,
                found,
                top: reference_step.top.clone(),
            });
        }
    } else {
        return Err(GoldenFailure::PartedAtStableStep {
            step,
            expected,
            found,
            top: reference_step.top.clone(),
        });
    };
    Ok(GoldenMatch::PartedAtUnstableStep { step, why })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::targets::Feature;

    fn golden_runs() -> Vec<GoldenRun> {
        let path = crate::project_root().join("tests/data/golden/greedy.jsonl");
        let text = std::fs::read_to_string(&path).expect("the golden data is committed");
        text.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    fn golden(model: &str, id_prefix: &str) -> GoldenRun {
        let path = crate::project_root().join("tests/data/golden/greedy.jsonl");
        let text = std::fs::read_to_string(&path).unwrap();
        let line = text
            .lines()
            .find(|line| {
                let value: serde_json::Value = serde_json::from_str(line).unwrap();
                value["model"] == model && value["id"] == id_prefix
            })
            .unwrap_or_else(|| panic!("no golden entry {model}/{id_prefix}"));
        serde_json::from_str(line).unwrap()
    }

    /// The reference ids with `step` replaced by `id`, and the ids after it scrambled: nothing
    /// after a parting may matter.
    fn parted(golden: &GoldenRun, step: usize, id: u32, len: usize) -> Vec<u32> {
        let mut ids = golden.tokens[..len].to_vec();
        ids[step] = id;
        for later in ids.iter_mut().skip(step + 1) {
            *later = 99_999;
        }
        ids
    }

    fn check(golden: &GoldenRun, generated: &[u32], requested: usize, expected: &str) {
        let found = match compare_with_golden(golden, generated, requested) {
            Ok(GoldenMatch::Equal { compared }) => format!("equal {compared}"),
            Ok(GoldenMatch::PartedAtUnstableStep {
                step,
                why: UnstableWhy::ReferenceDisagreesWithItself,
            }) => {
                format!("pass at {step}: reference disagrees")
            }
            Ok(GoldenMatch::PartedAtUnstableStep {
                step,
                why: UnstableWhy::ChoseSingleStepId,
            }) => {
                format!("pass at {step}: single-step id")
            }
            Ok(GoldenMatch::PartedAtUnstableStep {
                step,
                why: UnstableWhy::NearTie { .. },
            }) => {
                format!("pass at {step}: near tie")
            }
            Err(GoldenFailure::PartedAtStableStep { step, .. }) => {
                format!("fail at {step}: stable")
            }
            Err(GoldenFailure::WrongLength { expected, found }) => {
                format!("fail: length {found} for {expected}")
            }
            Err(GoldenFailure::NoStepData { step }) => format!("fail at {step}: no step data"),
        };
        assert_eq!(found, expected, "generated {generated:?}");
    }

    #[test]
    fn golden_rule_on_the_committed_reference() {
        let smol = golden("smollm2-135m-instruct-q4_1", "capital");
        // Step 14 of this run is a near tie: [33, -1.104383] against [34, -1.109165].
        let gemma_story = golden("gemma3-270m-q4_k_m", "story");
        let unstable_step = (0..gemma_story.tokens.len())
            .find(|&step| gemma_story.steps[step].id != gemma_story.tokens[step])
            .expect("the gemma story reference has a step where llama.cpp disagrees with itself");
        let single_step_id = gemma_story.steps[unstable_step].id;

        check(&smol, &smol.tokens[..16], 16, "equal 16");
        check(&smol, &smol.tokens, 32, "equal 32");
        // Asking for more than the reference holds compares what it holds.
        check(&smol, &smol.tokens, 40, "fail: length 32 for 40");
        check(&smol, &smol.tokens[..10], 16, "fail: length 10 for 16");
        check(
            &smol,
            &[smol.tokens.clone(), vec![1]].concat(),
            32,
            "fail: length 33 for 32",
        );
        check(&smol, &parted(&smol, 0, 260, 16), 16, "fail at 0: stable");
        check(&smol, &parted(&smol, 5, 2988, 16), 16, "fail at 5: stable");
        check(
            &smol,
            &parted(&smol, 14, 34, 16),
            16,
            "pass at 14: near tie",
        );
        check(
            &smol,
            &parted(&smol, 14, 34, 32),
            32,
            "pass at 14: near tie",
        );
        check(
            &gemma_story,
            &parted(&gemma_story, unstable_step, single_step_id, 32),
            32,
            &format!("pass at {unstable_step}: reference disagrees"),
        );
        check(
            &gemma_story,
            &parted(&gemma_story, unstable_step, 7, 32),
            32,
            &format!("pass at {unstable_step}: reference disagrees"),
        );
    }

    #[test]
    fn golden_rule_on_synthetic_steps() {
        let line = |steps: &str| {
            serde_json::from_str::<GoldenRun>(&format!(
                r#"{{"model":"m","prompt":"p","prompt_ids":[1],"tokens":[10,11,12],"steps":{steps}}}"#
            ))
            .unwrap()
        };
        let stable = line(
            r#"[{"id":10,"top":[[10,-0.1],[5,-3.0]]},{"id":11,"top":[[11,-0.5],[6,-1.0]]},{"id":12,"top":[]}]"#,
        );
        check(&stable, &[10, 11, 12], 3, "equal 3");
        check(&stable, &[10, 6, 0], 3, "fail at 1: stable");
        // No top data: the rule has nothing to accept a parting with.
        check(&stable, &[10, 11, 13], 3, "fail at 2: stable");
        // A ratio of exactly exp(-0.0202) = 0.98000 is the edge; just inside and just outside.
        let edge = line(
            r#"[{"id":10,"top":[[10,-1.0],[5,-1.0201]]},{"id":11,"top":[[11,-1.0],[6,-1.0203]]},{"id":12,"top":[]}]"#,
        );
        check(&edge, &[5, 0, 0], 3, "pass at 0: near tie");
        check(&edge, &[10, 6, 0], 3, "fail at 1: stable");
        let missing_steps = line(r#"[{"id":10,"top":[]}]"#);
        check(&missing_steps, &[10, 9, 9], 3, "fail at 1: no step data");
        // llama.cpp's one-token path chose 7 at step 0, unlike its batched run.
        let unstable =
            line(r#"[{"id":7,"top":[[7,-0.6],[10,-0.8]]},{"id":11,"top":[]},{"id":12,"top":[]}]"#);
        check(&unstable, &[7, 1, 1], 3, "pass at 0: reference disagrees");
    }

    #[test]
    fn every_committed_reference_parses_and_matches_itself() {
        let runs = golden_runs();
        assert_eq!(runs.len(), 14);
        for run in &runs {
            assert_eq!(
                run.steps.len(),
                run.tokens.len(),
                "{} {:?}",
                run.model,
                run.prompt
            );
            assert_eq!(
                compare_with_golden(run, &run.tokens, run.tokens.len()),
                Ok(GoldenMatch::Equal {
                    compared: run.tokens.len()
                })
            );
        }
    }

    #[test]
    fn run_json_is_the_last_object_line() {
        let parsed = RunJson::parse(
            "loading model\n{\"prompt_ids\":[1,2],\"tokens\":[3],\"text\":\" Paris\"}\n",
        )
        .unwrap();
        assert_eq!(
            (parsed.prompt_ids, parsed.tokens, parsed.text.as_str()),
            (vec![1, 2], vec![3], " Paris")
        );
        let error = RunJson::parse("Paris is the capital")
            .unwrap_err()
            .to_string();
        assert!(error.contains("expected a JSON object"), "{error}");
        let error = RunJson::parse("{\"tokens\":[1]}").unwrap_err().to_string();
        assert!(error.contains("prompt_ids"), "{error}");
    }

    fn manifest(target: &str, features: &[(&str, &str, Option<&str>)]) -> ExpectedManifest {
        ExpectedManifest {
            target: target.to_string(),
            features: features
                .iter()
                .map(|(name, state, reason)| Feature {
                    name: name.to_string(),
                    state: match *state {
                        "on" => FeatureState::On,
                        "off" => FeatureState::Off,
                        _ => FeatureState::Unsupported,
                    },
                    reason: reason.map(str::to_string),
                    tracking: Vec::new(),
                })
                .collect(),
        }
    }

    fn check_info(expected: &ExpectedManifest, info: &serde_json::Value, problems: &[&str]) {
        let found = check_info_json(expected, info);
        assert_eq!(found.len(), problems.len(), "problems {found:#?}");
        for (found, expected) in found.iter().zip(problems) {
            assert!(
                found.contains(expected),
                "expected a problem containing {expected:?}, found {found:?}"
            );
        }
    }

    /// `ember info --format json` of a build with `manifest`'s gates, as the engine writes its
    /// embedded manifest (`build.features[]` with name, state, enabled, reason, tracking).
    fn info_json(expected: &ExpectedManifest) -> serde_json::Value {
        let features: Vec<serde_json::Value> = expected
            .features
            .iter()
            .map(|f| {
                serde_json::json!({
                    "name": f.name,
                    "state": f.state.name(),
                    "enabled": f.state == FeatureState::On,
                    "reason": f.reason,
                    "tracking": f.tracking,
                })
            })
            .collect();
        serde_json::json!({
            "ember_version": "0.1.0",
            "build": { "target": expected.target, "features": features },
            "cpu": { "arch": "x86_64", "simd": "avx2", "physical_cores": 2 },
            "model": null,
        })
    }

    /// The committed gate table, shown the way `ember info --format json` shows a manifest.
    #[test]
    fn info_json_for_the_committed_gfx1201_gates() {
        let targets = targets::load().unwrap();
        let gfx1201 = ExpectedManifest::of(targets.target("gfx1201").unwrap());
        let info = info_json(&gfx1201);
        check_info(&gfx1201, &info, &[]);
        let vmm = gfx1201
            .features
            .iter()
            .position(|f| f.name == "vmm")
            .unwrap();
        let mut untracked = info.clone();
        untracked["build"]["features"][vmm]["tracking"]
            .as_array_mut()
            .unwrap()
            .retain(|l| l != "https://github.com/ROCm/rocm-systems/issues/2516");
        check_info(
            &gfx1201,
            &untracked,
            &["expected the tracking link https://github.com/ROCm/rocm-systems/issues/2516 of feature vmm"],
        );
        let mut on = info.clone();
        on["build"]["features"][vmm]["state"] = serde_json::json!("on");
        check_info(
            &gfx1201,
            &on,
            &["expected feature vmm to be off, found \"on\""],
        );
        // gfx1151 has VMM on: the gfx1201 manifest is wrong for it.
        let gfx1151 = ExpectedManifest::of(targets.target("gfx1151").unwrap());
        let problems = check_info_json(&gfx1151, &info);
        assert!(
            problems
                .iter()
                .any(|problem| problem == "expected feature vmm to be on, found \"off\""),
            "{problems:#?}"
        );
    }

    #[test]
    fn info_json_against_the_expected_manifest() {
        let gfx1201 = manifest(
            "gfx1201",
            &[
                ("vmm", "off", Some("hipMemSetAccess fails when a mapping is grown while several reservations exist")),
                ("peer_copy", "on", None),
                ("xnack", "unsupported", Some("RDNA has no XNACK")),
            ],
        );
        let good = info_json(&gfx1201);
        check_info(&gfx1201, &good, &[]);
        let mut changed = good.clone();
        changed["build"]["features"][0]["reason"] = serde_json::json!("many reservations");
        check_info(&gfx1201, &changed, &["expected the reason vmm is off"]);
        let mut changed = good.clone();
        changed["build"]["features"][1]["state"] = serde_json::json!("off");
        check_info(
            &gfx1201,
            &changed,
            &["expected feature peer_copy to be on, found \"off\""],
        );
        let mut changed = good.clone();
        changed["build"]["features"]
            .as_array_mut()
            .unwrap()
            .remove(2);
        check_info(
            &gfx1201,
            &changed,
            &["expected feature xnack (unsupported) in `ember info`, found none"],
        );
        // A note on an enabled feature is not required to be shown.
        let noted = manifest("cpu", &[("vmm", "on", Some("a note"))]);
        let mut shown = info_json(&noted);
        shown["build"]["features"][0]["reason"] = serde_json::Value::Null;
        check_info(&noted, &shown, &[]);
        let mut changed = good.clone();
        changed["build"]["target"] = serde_json::json!("gfx1200");
        check_info(
            &gfx1201,
            &changed,
            &["expected target gfx1201 in `ember info`, found Some(\"gfx1200\")"],
        );
        // Not JSON of the manifest's shape at all: every expectation is reported.
        check_info(
            &gfx1201,
            &serde_json::json!({}),
            &[
                "expected target gfx1201",
                "expected feature vmm (off)",
                "expected feature peer_copy (on)",
                "expected feature xnack (unsupported)",
            ],
        );
    }

    fn device(id: &str, arch: &str, name: &str) -> serde_json::Value {
        serde_json::json!({ "id": id, "arch": arch, "name": name })
    }

    fn listing(devices: &[serde_json::Value]) -> serde_json::Value {
        serde_json::json!({
            "cpu": { "arch": "x86_64", "simd": "avx2", "physical_cores": 8 },
            "runtimes": [],
            "devices": devices,
            "failures": [],
        })
    }

    #[test]
    fn devices_against_the_target() {
        assert_eq!(
            devices_verdict("cpu", &listing(&[])),
            DevicesVerdict::Listed("cpu x86_64 (avx2 SIMD, 8 physical cores)".to_string())
        );
        assert_eq!(
            devices_verdict("gfx1201", &listing(&[])),
            DevicesVerdict::GpuAbsent("gfx1201".to_string())
        );
        assert_eq!(
            devices_verdict(
                "gfx1201",
                &listing(&[device("hip:0", "gfx1201", "Radeon AI PRO R9700")])
            ),
            DevicesVerdict::Listed(
                "gfx1201 GPU listed: hip:0 Radeon AI PRO R9700 (gfx1201)".to_string()
            )
        );
        // gfx1200 is not gfx1201: a code object for one does not run on the other.
        assert_eq!(
            devices_verdict("gfx1201", &listing(&[device("hip:0", "gfx1200", "R9070")])),
            DevicesVerdict::GpuAbsent("gfx1201".to_string())
        );
        assert_eq!(
            devices_verdict(
                "sm_90",
                &listing(&[device("cuda:0", "sm_90", "NVIDIA H200")])
            ),
            DevicesVerdict::Listed("sm_90 GPU listed: cuda:0 NVIDIA H200 (sm_90)".to_string())
        );
        assert_eq!(
            devices_verdict("cpu", &serde_json::json!({})),
            DevicesVerdict::Empty
        );
    }

    #[test]
    fn artifact_names() {
        let check = |name: &str, expected: Result<(&str, Os, &str), &str>| {
            let found = ArtifactName::parse(name);
            match (found, expected) {
                (Ok(found), Ok((version, os, target))) => {
                    assert_eq!(
                        found,
                        ArtifactName {
                            version: version.to_string(),
                            os,
                            target: target.to_string()
                        }
                    )
                }
                (Err(error), Err(message)) => {
                    assert!(error.to_string().contains(message), "{name}: {error}")
                }
                (found, expected) => panic!("{name}: expected {expected:?}, found {found:?}"),
            }
        };
        check(
            "ember-0.1.0-linux-gfx1201-x64.tar.gz",
            Ok(("0.1.0", Os::Linux, "gfx1201")),
        );
        check(
            "ember-0.1.0-windows-cpu-x64.zip",
            Ok(("0.1.0", Os::Windows, "cpu")),
        );
        check(
            "ember-0.2.0-rc.1-linux-sm_90-x64.tar.gz",
            Ok(("0.2.0-rc.1", Os::Linux, "sm_90")),
        );
        check(
            "ember-0.1.0-windows-cpu-x64.tar.gz",
            Err("other OS's extension"),
        );
        check(
            "ember-0.1.0-macos-cpu-x64.tar.gz",
            Err("found OS \"macos\""),
        );
        check(
            "ember-linux-cpu-x64.tar.gz",
            Err("found ember-linux-cpu-x64.tar.gz"),
        );
        check("llama-0.1.0-linux-cpu-x64.tar.gz", Err("found llama-0.1.0"));
        check(
            "ember-0.1.0-linux-cpu.tar.gz",
            Err("found ember-0.1.0-linux-cpu.tar.gz"),
        );
    }

    /// The smoke test reads back the names `cargo xtask package` writes.
    #[test]
    fn artifact_names_round_trip_through_package() {
        for (version, os, target) in [
            ("0.1.0", Os::Linux, "gfx1201"),
            ("1.2.3-rc.1", Os::Windows, "cpu"),
            ("0.1.0", Os::Linux, "sm_90"),
        ] {
            let parsed =
                ArtifactName::parse(&crate::package::archive_name(version, os, target)).unwrap();
            assert_eq!(
                parsed,
                ArtifactName {
                    version: version.to_string(),
                    os,
                    target: target.to_string()
                }
            );
        }
    }

    #[test]
    fn sha256sums_lines() {
        let digest = "a".repeat(64);
        assert_eq!(
            parse_sha256sums(&format!("{digest}  ember\n{digest} *lib/x.co\n")),
            Ok(vec![
                (digest.clone(), "ember".to_string()),
                (digest.clone(), "lib/x.co".to_string())
            ])
        );
        assert!(parse_sha256sums(&format!("{digest} ember"))
            .unwrap_err()
            .contains("line 1"));
        assert!(parse_sha256sums(&format!("{}  ember", "g".repeat(64)))
            .unwrap_err()
            .contains("expected `<64 hex digits>  <path>`"));
        assert!(parse_sha256sums("abc  ember").is_err());
        assert!(parse_sha256sums(&format!("{digest}  ")).is_err());
    }

    #[test]
    fn sha256sums_against_files() {
        let dir = crate::target_dir().join("xtask-test-sha256sums");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ember"), b"binary").unwrap();
        let good = hex::encode(Sha256::digest(b"binary"));
        std::fs::write(dir.join("SHA256SUMS"), format!("{good}  ember\n")).unwrap();
        assert_eq!(verify_sha256sums(&dir), Ok(1));
        std::fs::write(dir.join("ember"), b"changed").unwrap();
        let problems = verify_sha256sums(&dir).unwrap_err();
        assert!(
            problems[0].starts_with(&format!("ember: expected SHA-256 {good}, found")),
            "{problems:?}"
        );
        std::fs::write(dir.join("SHA256SUMS"), format!("{good}  ../ember\n")).unwrap();
        assert!(verify_sha256sums(&dir).unwrap_err()[0].contains("inside the package"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn archive_checksum_beside_the_archive() {
        let dir = crate::target_dir().join("xtask-test-archive-checksum");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let archive = dir.join("ember-0.1.0-linux-cpu-x64.tar.gz");
        std::fs::write(&archive, b"archive bytes").unwrap();
        let sums = dir.join("ember-0.1.0-linux-cpu-x64.tar.gz.sha256");
        let digest = hex::encode(Sha256::digest(b"archive bytes"));
        std::fs::write(
            &sums,
            format!("{digest}  ember-0.1.0-linux-cpu-x64.tar.gz\n"),
        )
        .unwrap();
        verify_archive_checksum(&archive, &archive).unwrap();
        let copy = dir.join("copy.tar.gz");
        std::fs::write(&copy, b"archive bytes, then more").unwrap();
        let error = verify_archive_checksum(&archive, &copy)
            .unwrap_err()
            .to_string();
        assert!(error.contains("is damaged or was rewritten"), "{error}");
        std::fs::write(
            &sums,
            format!("{digest}  ember-0.1.0-linux-gfx1201-x64.tar.gz\n"),
        )
        .unwrap();
        let error = verify_archive_checksum(&archive, &archive)
            .unwrap_err()
            .to_string();
        assert!(
            error.ends_with("found ember-0.1.0-linux-gfx1201-x64.tar.gz"),
            "{error}"
        );
        std::fs::remove_file(&sums).unwrap();
        let error = verify_archive_checksum(&archive, &archive)
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("reading "), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn image_config_checks() {
        let config = |json: &str| serde_json::from_str::<ImageConfig>(json).unwrap();
        let run = docker::GPU_RUN_ARGS.join(" ");
        let good = format!(
            r#"{{"User":"ember","Healthcheck":{{"Test":["CMD","/usr/local/bin/ember-healthcheck"]}},"Entrypoint":["/usr/local/bin/ember-entrypoint"],"Cmd":["serve"],"ExposedPorts":{{"8080/tcp":{{}}}},"Env":["PATH=/usr/bin","EMBER_MODELS_DIR=/models"],"Labels":{{"{}":"docker run {run} IMAGE"}}}}"#,
            docker::LABEL_RUN
        );
        assert_eq!(check_image_config(&config(&good)), Vec::<String>::new());
        let root = good.replace(r#""User":"ember""#, r#""User":"0:0""#);
        assert_eq!(
            check_image_config(&config(&root)),
            vec![r#"expected a non-root USER, found "0:0""#.to_string()]
        );
        let no_health = good.replace(
            r#""Healthcheck":{"Test":["CMD","/usr/local/bin/ember-healthcheck"]}"#,
            r#""Healthcheck":null"#,
        );
        assert_eq!(
            check_image_config(&config(&no_health)),
            vec!["expected a HEALTHCHECK, found none".to_string()]
        );
        let no_kfd = good.replace("--device /dev/kfd", "");
        assert!(check_image_config(&config(&no_kfd))[0].contains("--device /dev/kfd"));
        // The image of before the server: `ember` as the entrypoint and `info` as the command.
        let info_image = good
            .replace("/usr/local/bin/ember-entrypoint", "/opt/ember/ember")
            .replace(r#""Cmd":["serve"]"#, r#""Cmd":["info"]"#)
            .replace(r#""ExposedPorts":{"8080/tcp":{}},"#, "");
        assert_eq!(
            check_image_config(&config(&info_image)),
            vec![
                r#"expected entrypoint ["/usr/local/bin/ember-entrypoint"], found Some(["/opt/ember/ember"])"#.to_string(),
                r#"expected the default command ["serve"], found Some(["info"])"#.to_string(),
                "expected the image to expose 8080/tcp, found None".to_string(),
            ]
        );
    }
}
