//! Tidy checks: properties of the repository itself, run as ordinary tests (rust-analyzer's
//! `xtask/src/tidy.rs`): the committed release workflow matches targets.toml, the workflows pass
//! actionlint where it is installed, and the CI scripts are executable shell that parses.

use crate::matrix;
use crate::toolchain;

#[test]
fn release_workflow_matrix_matches_targets_toml() {
    let targets = crate::targets::load().unwrap();
    let root = crate::project_root();
    if let Err(error) = matrix::check_workflow(&targets, &matrix::default_workflow_path(&root)) {
        panic!("{error:#}");
    }
}

#[test]
fn workflows_pass_actionlint_when_it_is_installed() {
    // `cargo xtask test` runs actionlint unconditionally and fails without it; this test covers a
    // plain `cargo test` on a machine where .ci/setup-actionlint.sh has run.
    let Some(actionlint) = toolchain::actionlint() else {
        eprintln!(
            "actionlint not installed ({}): skipping the workflow lint here",
            toolchain::SETUP_ACTIONLINT
        );
        return;
    };
    let root = crate::project_root();
    let output = std::process::Command::new(&actionlint)
        .args(matrix::workflow_files(&root))
        .current_dir(&root)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "actionlint found problems:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn ci_scripts_are_executable_and_parse() {
    use std::os::unix::fs::PermissionsExt;
    let root = crate::project_root();
    let mut scripts: Vec<std::path::PathBuf> = std::fs::read_dir(root.join(".ci"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_file())
        .collect();
    scripts.sort();
    assert!(
        scripts.iter().any(|path| path.ends_with(".ci/run")),
        "{scripts:?}"
    );
    for path in scripts {
        let script = path.display();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o111, 0o111, "{script} is not executable");
        let status = std::process::Command::new("bash")
            .arg("-n")
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success(), "{script} does not parse");
    }
}

/// Every path under cargo's target directory comes from `crate::target_dir()` (`cargo metadata`),
/// so builds work where `CARGO_TARGET_DIR` or `build.target-dir` put them: no module spells the
/// default `target/` itself (main.rs's fallback for a broken cargo is the one exception).
#[test]
fn no_module_assumes_the_default_target_directory() {
    let root = crate::project_root();
    let mut offenders = Vec::new();
    for entry in std::fs::read_dir(root.join("xtask/src")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".rs") || name == "tidy.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (index, line) in text.lines().enumerate() {
            let spelled = line.contains(&format!("join({:?})", "target"))
                || line.contains(&format!("\"{}/", "target"));
            let fallback = name == "main.rs" && line.contains("project_root().join(");
            if spelled && !fallback && !line.trim_start().starts_with("//") {
                offenders.push(format!("xtask/src/{name}:{}: {}", index + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "use crate::target_dir():\n{}",
        offenders.join("\n")
    );
}
