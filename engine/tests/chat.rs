//! `ember chat` and the prompt flags of `ember run`, driven as a user would (standard input not
//! a terminal) on the pinned SmolLM2 model. Expected outputs are never written down: each is
//! compared with what another route to the same computation gives.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const MODEL: &str = "smollm2-135m-instruct-q4_1";

fn ember() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ember"));
    cmd.env_remove("EMBER_LOG");
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn run_ok(args: &[&str], stdin: Option<&str>) -> Output {
    let model = common::model_path(MODEL);
    let mut child = ember()
        .arg("run")
        .arg("-m")
        .arg(&model)
        .args(["-t", "2", "--temp", "0"])
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    out
}

/// `[P prompt tokens, G generated in S s, stop: R]` lines of `ember chat -v`.
fn turn_stats(stderr: &str) -> Vec<(usize, usize, String)> {
    stderr
        .lines()
        .filter_map(|l| {
            let l = l.strip_prefix('[')?.strip_suffix(']')?;
            let (prompt, rest) = l.split_once(" prompt tokens, ")?;
            let (generated, rest) = rest.split_once(" generated in ")?;
            let stop = rest.split_once("stop: ")?.1;
            Some((
                prompt.parse().ok()?,
                generated.parse().ok()?,
                stop.to_string(),
            ))
        })
        .collect()
}

#[test]
fn run_reads_the_prompt_from_stdin_and_files_and_stops_on_a_string() {
    let prompt = "The three primary colours are";
    let direct = text(&run_ok(&["-p", prompt, "-n", "24"], None).stdout);
    let piped = text(&run_ok(&["-p", "-", "-n", "24"], Some(prompt)).stdout);
    assert_eq!(piped, direct);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    let from_file = text(&run_ok(&["-f", file.to_str().unwrap(), "-n", "24"], None).stdout);
    assert_eq!(from_file, direct);

    // Stop at a word from the middle of the greedy output: the output is what came before it.
    let words: Vec<&str> = direct.split_whitespace().collect();
    assert!(words.len() >= 4, "{direct:?}");
    let stop = words[words.len() / 2];
    let cut = direct.find(stop).unwrap();
    let stopped = run_ok(&["-p", prompt, "-n", "24", "--stop", stop], None);
    assert_eq!(
        text(&stopped.stdout).trim_end(),
        direct[..cut].trim_end(),
        "stop {stop:?}"
    );
    assert!(
        text(&stopped.stderr).contains("stop: end of generation"),
        "{}",
        text(&stopped.stderr)
    );
}

#[test]
fn run_takes_a_system_message_and_no_limit() {
    let prompt_tokens = |o: &Output| -> usize {
        let e = text(&o.stderr);
        let line = e
            .lines()
            .find(|l| l.starts_with('[') && l.contains(" prompt tokens in "))
            .unwrap_or_else(|| panic!("no stats line in {e}"));
        line[1..].split(' ').next().unwrap().parse().unwrap()
    };
    // The system message is part of the prompt: a longer one gives a longer prompt, and either
    // differs from the template's own default.
    let short = run_ok(
        &["--system", "Answer in French.", "-p", "Hello", "-n", "4"],
        None,
    );
    let long = run_ok(
        &[
            "--system",
            "Answer in French. Be brief and polite, always.",
            "-p",
            "Hello",
            "-n",
            "4",
        ],
        None,
    );
    let chat = run_ok(&["--chat", "-p", "Hello", "-n", "4"], None);
    let (short, long, chat) = (
        prompt_tokens(&short),
        prompt_tokens(&long),
        prompt_tokens(&chat),
    );
    assert!(long > short + 4, "{long} vs {short}");
    assert_ne!(short, chat);

    // -n -1 runs to the end of generation or of a (small) context.
    let unlimited = run_ok(&["-p", "Once upon a time", "-n", "-1", "-c", "48"], None);
    let e = text(&unlimited.stderr);
    assert!(
        e.contains("stop: end of generation") || e.contains("stop: context full"),
        "{e}"
    );

    // -n 0 generates nothing and claims no speed.
    let none = run_ok(&["-p", "Hello", "-n", "0"], None);
    let e = text(&none.stderr);
    assert!(e.contains("0 generated (-)"), "{e}");

    let bad = ember()
        .args(["run", "-m", "x", "-p", "y", "-n", "-2"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("-1 for no limit"),
        "{}",
        text(&bad.stderr)
    );
}

#[test]
fn chat_keeps_the_history_and_resets_it() {
    let model = common::model_path(MODEL);
    let question = "What is the capital of France?";
    let mut child = ember()
        .arg("chat")
        .arg("-m")
        .arg(&model)
        .args(["-t", "2", "--temp", "0", "-n", "24", "-v"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let script =
        format!("{question}\nAnd of Italy?\n/nope\n/reset\n{question}\n/exit\nnever read\n");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let stats = turn_stats(&stderr);
    assert_eq!(stats.len(), 3, "{stderr}");
    // The second prompt holds the first exchange; after /reset the first prompt comes back.
    assert!(stats[1].0 > stats[0].0 + stats[0].1, "{stats:?}");
    assert_eq!(stats[2].0, stats[0].0, "{stats:?}");
    assert!(stderr.contains("unknown command /nope"), "{stderr}");
    assert!(stderr.contains("[conversation reset]"), "{stderr}");

    // The first answer is what `ember run --chat` gives for the same message.
    let single = run_ok(&["--chat", "-p", question, "-n", "24"], None);
    let first_answer = text(&single.stdout);
    assert!(
        stdout.starts_with(first_answer.trim_end()),
        "chat:\n{stdout}\nrun:\n{first_answer}"
    );
}

/// Ctrl-C (SIGINT) during an answer stops that answer; the conversation goes on.
#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_answer_not_the_chat() {
    let model = common::model_path(MODEL);
    let mut child = ember()
        .arg("chat")
        .arg("-m")
        .arg(&model)
        .args(["-t", "2", "--temp", "0", "-n", "400", "-v"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let (err_tx, err_rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = err_tx.send(line);
        }
    });
    let (out_tx, out_rx) = mpsc::channel::<usize>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || out_tx.send(n).is_err() {
                break;
            }
        }
    });
    stdin
        .write_all(b"Write a very long story about a dragon who learns to fly.\n")
        .unwrap();
    // The answer has started streaming.
    out_rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the answer starts");
    // SAFETY: kill sends a signal to the child process this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !seen.iter().any(|l: &String| l.contains("stop: ")) {
        let line = err_rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("no stats line after Ctrl-C: {seen:?}"));
        seen.push(line);
    }
    assert!(seen.iter().any(|l| l == "[stopped]"), "{seen:?}");
    assert!(
        seen.last().unwrap().ends_with("stop: cancelled]"),
        "{seen:?}"
    );
    // Another turn is answered, then the chat ends normally.
    stdin.write_all(b"What is two plus two?\n/exit\n").unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    let rest: Vec<String> = err_rx.try_iter().collect();
    assert!(status.success(), "{status:?} {seen:?} {rest:?}");
    let stats = turn_stats(&rest.join("\n"));
    assert_eq!(stats.len(), 1, "{rest:?}");
    assert_ne!(stats[0].2, "cancelled", "{rest:?}");
    assert!(stats[0].1 > 0, "{rest:?}");
}

/// `ember chat` on a pseudo-terminal, as a user at a terminal has it: line editing on, Ctrl-C
/// typed as a key (the terminal turns it into SIGINT only while an answer streams; at the prompt
/// the line editor reads it). Two turns, then Ctrl-C during a long answer (that answer stops,
/// the program does not), another turn, and /exit. Every wait is for output, never for time.
#[cfg(unix)]
mod terminal {
    use std::io::{Read, Write};
    use std::os::fd::OwnedFd;
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Stdio};
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::{Duration, Instant};

    use super::{common, ember, turn_stats, MODEL};

    /// Generous: a loaded two-core CI machine reads prompts and writes tokens slowly.
    const WAIT: Duration = Duration::from_secs(300);

    /// What the terminal has shown so far, and whether the program has closed it.
    #[derive(Default)]
    struct Screen {
        text: Mutex<(String, bool)>,
        changed: Condvar,
    }

    impl Screen {
        /// Waits until the program closes the terminal (it exits).
        fn wait_closed(&self) {
            let deadline = Instant::now() + WAIT;
            let mut guard = self.text.lock().unwrap();
            while !guard.1 {
                let left = deadline.saturating_duration_since(Instant::now());
                assert!(
                    !left.is_zero(),
                    "the program did not end; the terminal shows:\n{}",
                    guard.0
                );
                guard = self.changed.wait_timeout(guard, left).unwrap().0;
            }
        }

        /// Waits until `done` holds for the text shown; the text.
        fn wait_for(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
            let deadline = Instant::now() + WAIT;
            let mut guard = self.text.lock().unwrap();
            loop {
                if done(&guard.0) {
                    return guard.0.clone();
                }
                let left = deadline.saturating_duration_since(Instant::now());
                assert!(
                    !left.is_zero() && !guard.1,
                    "waited for {what}; the terminal shows:\n{}",
                    guard.0
                );
                guard = self.changed.wait_timeout(guard, left).unwrap().0;
            }
        }
    }

    struct Session {
        child: Child,
        keyboard: std::fs::File,
        screen: Arc<Screen>,
    }

    impl Session {
        fn start(args: &[&str]) -> Session {
            let size = nix::pty::Winsize {
                ws_row: 40,
                ws_col: 200,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let pty = nix::pty::openpty(&size, None).expect("openpty");
            let slave: OwnedFd = pty.slave;
            let mut command = ember();
            command
                .arg("chat")
                .args(args)
                .env("TERM", "xterm")
                .stdin(Stdio::from(slave.try_clone().unwrap()))
                .stdout(Stdio::from(slave.try_clone().unwrap()))
                .stderr(Stdio::from(slave.try_clone().unwrap()));
            // SAFETY: between fork and exec only async-signal-safe calls: setsid makes the child
            // a session leader, and TIOCSCTTY makes its standard input (the terminal) its
            // controlling terminal, so that a typed Ctrl-C reaches it as SIGINT.
            unsafe {
                command.pre_exec(|| {
                    if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = command.spawn().unwrap();
            // Only the child holds the terminal now: when it exits, reads of the master end.
            drop(command);
            drop(slave);
            let master = std::fs::File::from(pty.master);
            let keyboard = master.try_clone().unwrap();
            let mut answers = master.try_clone().unwrap();
            let screen = Arc::new(Screen::default());
            let shown = Arc::clone(&screen);
            std::thread::spawn(move || {
                let mut reader = master;
                let mut buf = [0u8; 4096];
                loop {
                    let n = reader.read(&mut buf).unwrap_or(0);
                    let mut guard = shown.text.lock().unwrap();
                    if n == 0 {
                        guard.1 = true;
                        shown.changed.notify_all();
                        return;
                    }
                    let chunk = String::from_utf8_lossy(&buf[..n]).into_owned();
                    // A line editor may ask where the cursor is; a terminal answers.
                    for _ in 0..chunk.matches("\x1b[6n").count() {
                        let _ = answers.write_all(b"\x1b[1;1R");
                    }
                    guard.0.push_str(&chunk);
                    shown.changed.notify_all();
                }
            });
            Session {
                child,
                keyboard,
                screen,
            }
        }

        fn type_keys(&mut self, keys: &str) {
            self.keyboard.write_all(keys.as_bytes()).unwrap();
            self.keyboard.flush().unwrap();
        }

        /// Types `line` and Enter, and waits for the answer's stats line; all the turns' stats.
        fn turn(&mut self, line: &str) -> Vec<(usize, usize, String)> {
            let before = turn_stats(&self.shown()).len();
            self.type_keys(&format!("{line}\r"));
            let text = self.screen.wait_for("the answer's stats line", |t| {
                turn_stats(&plain(t)).len() > before
            });
            turn_stats(&plain(&text))
        }

        fn shown(&self) -> String {
            plain(&self.screen.text.lock().unwrap().0)
        }
    }

    /// The terminal's text as lines: carriage returns and escape sequences dropped.
    fn plain(text: &str) -> String {
        let mut out = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\x1b' => {
                    // CSI: ESC [ parameters final-byte; other escapes are two characters.
                    if chars.peek() == Some(&'[') {
                        chars.next();
                        for c in chars.by_ref() {
                            if ('@'..='~').contains(&c) {
                                break;
                            }
                        }
                    } else {
                        chars.next();
                    }
                }
                '\r' => {}
                c => out.push(c),
            }
        }
        out
    }

    #[test]
    fn a_conversation_on_a_terminal_survives_ctrl_c() {
        let model = common::model_path(MODEL);
        let mut session = Session::start(&[
            "-m",
            model.to_str().unwrap(),
            "-t",
            "2",
            "--temp",
            "0",
            // Answers of up to 64 tokens keep the test short; the Ctrl-C below comes a few
            // tokens into one, leaving some sixty tokens' time for the key to arrive.
            "-n",
            "64",
            "-v",
        ]);
        // The commands are shown on a terminal, then the prompt.
        session.screen.wait_for("the prompt", |t| {
            plain(t).contains("/exit") && t.contains("> ")
        });

        let stats = session.turn("What is the capital of France?");
        assert_eq!(stats.len(), 1);
        let stats = session.turn("And of Italy?");
        assert_eq!(stats.len(), 2);
        // The second prompt holds the first exchange.
        assert!(stats[1].0 > stats[0].0 + stats[0].1, "{stats:?}");

        // A long answer; Ctrl-C once it is streaming.
        let story = "Write a very long story about a dragon who learns to fly.";
        session.type_keys(&format!("{story}\r"));
        let echoed = session.screen.wait_for("the story request's echo", |t| {
            plain(t).contains(&format!("{story}\n"))
        });
        assert!(plain(&echoed).contains(story));
        // The words after the last echo of the request, once they are not the line editor's
        // own echo of it (the terminal may show the typed line first, then the editor's
        // redraw starting with its prompt "> ", and Ctrl-C must come once the answer streams).
        session.screen.wait_for("the answer to start", |t| {
            let text = plain(t);
            text.rfind(&format!("{story}\n")).is_some_and(|at| {
                let after = &text[at + story.len() + 1..];
                !after.trim_start().starts_with('>') && after.split_whitespace().count() >= 3
            })
        });
        session.type_keys("\x03");
        let text = session.screen.wait_for("the stopped answer's stats", |t| {
            turn_stats(&plain(t)).len() == 3
        });
        let stats = turn_stats(&plain(&text));
        assert_eq!(stats[2].2, "cancelled", "{stats:?}");
        assert!(plain(&text).contains("[stopped]"), "{}", plain(&text));
        // Stopped before its 64 tokens.
        assert!(stats[2].1 < 64, "{stats:?}");

        // The program goes on: another turn is answered in full.
        let stats = session.turn("What is two plus two?");
        assert_eq!(stats.len(), 4);
        assert_ne!(stats[3].2, "cancelled", "{stats:?}");
        assert!(stats[3].1 > 0, "{stats:?}");

        session.type_keys("/exit\r");
        session.screen.wait_closed();
        let status = session.child.wait().unwrap();
        assert!(status.success(), "{status:?}\n{}", session.shown());
    }
}
