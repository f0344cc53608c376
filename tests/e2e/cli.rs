//! The command lines: every binary answers `--help` and `--version`, refuses
//! a bad argument by name with exit status 2 (no stack trace, even with
//! RUST_BACKTRACE set), and prints shell completions that a real bash uses.

use std::process::{Command, Output};

use relay_tests::binary;

const BINARIES: [&str; 4] = ["relay-api", "relay-dispatcher", "relay-dev", "relay-bench"];

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(binary(bin).unwrap()).args(args).env("RUST_BACKTRACE", "1").output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_binary_has_help_and_a_version() {
    for bin in BINARIES {
        let help = run(bin, &["--help"]);
        assert_eq!(help.status.code(), Some(0), "{bin} --help: {}", text(&help.stderr));
        let out = text(&help.stdout);
        assert!(out.contains(&format!("Usage: {bin}")), "{bin} --help says how to call it: {out}");
        assert!(out.contains("completions"), "{bin} --help lists its completions command: {out}");

        let version = run(bin, &["--version"]);
        assert_eq!(version.status.code(), Some(0), "{bin} --version");
        assert_eq!(text(&version.stdout).trim(), format!("{bin} {}", env!("CARGO_PKG_VERSION")));
    }
}

#[test]
fn a_bad_argument_is_named_and_exits_2_without_a_stack_trace() {
    let cases: [(&str, &[&str], &str); 6] = [
        ("relay-api", &["bogus"], "'bogus'"),
        ("relay-api", &["--bogus"], "'--bogus'"),
        ("relay-dispatcher", &["--threads", "4"], "'--threads'"),
        ("relay-dev", &["receive", "--port", "ninety"], "'--port <PORT>'"),
        ("relay-dev", &["bootstrap", "https://127.0.0.1:1"], "<CERTS_DIR>"),
        ("relay-bench", &["w9"], "unknown workload \"w9\""),
    ];
    for (bin, args, named) in cases {
        let out = run(bin, args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bin} {args:?}: {err}");
        assert!(err.contains(named), "{bin} {args:?} names {named}: {err}");
        assert!(!err.contains("backtrace") && !err.contains("Backtrace"), "{bin} {args:?} printed a stack trace: {err}");
        assert!(out.stdout.is_empty(), "{bin} {args:?} did nothing but complain");
    }
}

/// Completes `line`'s last word in a real bash with `bin`'s script.
fn complete_in_bash(bin: &str, words: &[&str]) -> Vec<String> {
    let script = run(bin, &["completions", "bash"]);
    assert_eq!(script.status.code(), Some(0), "{bin} completions bash");
    let function = format!("_{}", bin.replace('-', "__"));
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let program = format!(
        "{}\nCOMP_WORDS=({}); COMP_CWORD={}; {function} {bin} '{}' '{}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        text(&script.stdout),
        quoted.join(" "),
        words.len() - 1,
        words[words.len() - 1],
        words[words.len() - 2],
    );
    let out = Command::new("bash").arg("-c").arg(program).output().unwrap();
    assert!(out.status.success(), "bash: {}", text(&out.stderr));
    text(&out.stdout).lines().map(str::to_owned).filter(|l| !l.is_empty()).collect()
}

#[test]
fn bash_completes_commands_and_their_options() {
    assert_eq!(complete_in_bash("relay-dev", &["relay-dev", "rec"]), ["receive"]);
    assert_eq!(complete_in_bash("relay-dev", &["relay-dev", "receive", "--p"]), ["--port", "--public-key"]);
    assert_eq!(complete_in_bash("relay-api", &["relay-api", "mig"]), ["migrate"]);
    assert_eq!(complete_in_bash("relay-api", &["relay-api", "completions", "z"]), ["zsh"]);

    for bin in BINARIES {
        let zsh = run(bin, &["completions", "zsh"]);
        assert_eq!(zsh.status.code(), Some(0), "{bin} completions zsh");
        assert!(text(&zsh.stdout).starts_with(&format!("#compdef {bin}")), "{bin}'s zsh script");
    }
}
