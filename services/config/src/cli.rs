//! What every command line shares: shell completion scripts.
//!
//! clap_complete 4.6's bash script never completes past a subcommand when
//! the binary's name has a hyphen (clap-rs/clap#6421, #6529: the dispatch
//! loop spells the state `relay__dev__subcmd__receive`, the case arms
//! `relay__subcmd__dev__subcmd__receive`), which every Relay binary has. The
//! arms are respelled the loop's way here until a release fixes it; the
//! tests source the script in a real bash and complete a subcommand's
//! option.

use std::io::Write;

pub use clap_complete::Shell;

/// The `completions <SHELL>` command every binary has.
#[derive(clap::Args)]
pub struct Completions {
    #[arg(value_enum)]
    pub shell: Shell,
}

impl Completions {
    /// Prints `bin`'s script (its command line being `C`) to standard output.
    pub fn print<C: clap::CommandFactory>(&self, bin: &str) -> std::io::Result<()> {
        completions(self.shell, &mut C::command(), bin, &mut std::io::stdout())
    }
}

/// Writes `bin`'s completion script for `shell`.
pub fn completions(shell: Shell, cmd: &mut clap::Command, bin: &str, out: &mut dyn Write) -> std::io::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(shell, cmd, bin, &mut script);
    let mut script = String::from_utf8_lossy(&script).into_owned();
    if shell == Shell::Bash && bin.contains('-') {
        let loop_spelling = bin.replace('-', "__");
        let arm_spelling = bin.replace('-', "__subcmd__");
        script = script.replace(&format!("{arm_spelling}__subcmd__"), &format!("{loop_spelling}__subcmd__"));
    }
    out.write_all(script.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd() -> clap::Command {
        clap::Command::new("my-app")
            .subcommand(clap::Command::new("thunder").arg(clap::Arg::new("lightning").long("lightning").action(clap::ArgAction::SetTrue)))
    }

    /// Completes `words` (the last one being typed) with the script in bash.
    fn complete(shell_script: &str, words: &[&str]) -> String {
        let script = format!(
            "{shell_script}\nCOMP_WORDS=({words}); COMP_CWORD={cword}; _my__app my-app '{cur}' '{prev}'; echo \"${{COMPREPLY[*]}}\"",
            words = words.join(" "),
            cword = words.len() - 1,
            cur = words[words.len() - 1],
            prev = words[words.len() - 2],
        );
        let out = std::process::Command::new("bash").arg("-c").arg(script).output().expect("bash runs");
        assert!(out.status.success(), "bash failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    #[test]
    fn bash_completes_a_subcommands_options_for_a_hyphenated_binary() {
        let mut script = Vec::new();
        completions(Shell::Bash, &mut cmd(), "my-app", &mut script).unwrap();
        let script = String::from_utf8(script).unwrap();
        assert_eq!(complete(&script, &["my-app", "thu"]), "thunder");
        assert_eq!(complete(&script, &["my-app", "thunder", "--l"]), "--lightning");
    }

    #[test]
    fn zsh_gets_a_compdef_script() {
        let mut script = Vec::new();
        completions(Shell::Zsh, &mut cmd(), "my-app", &mut script).unwrap();
        let script = String::from_utf8(script).unwrap();
        assert!(script.starts_with("#compdef my-app"), "{}", &script[..script.len().min(200)]);
        assert!(script.contains("--lightning"), "the subcommand's option is in the script");
    }
}
