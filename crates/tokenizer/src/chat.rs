//! Chat templates: the Jinja template a model ships in `tokenizer.chat_template` that turns a list
//! of messages into the prompt text the model was fine-tuned on.
//!
//! Templates run in minijinja configured like Hugging Face's `apply_chat_template` (`trim_blocks`
//! and `lstrip_blocks` on), with the helpers HF templates call: `raise_exception(msg)`,
//! `strftime_now(format)`, and Python string/dict/list methods (`.strip()`, `.startswith()`,
//! `.items()`, ...). A template is untrusted input: it runs on a fuel budget, so one that loops
//! without end fails instead of hanging, and its output is capped in size.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{Tokenizer, TokenizerError};

/// Instructions one render may execute by default. A long conversation takes tens of thousands;
/// this leaves a wide margin and still stops a runaway template within about a second (release
/// build).
pub const DEFAULT_FUEL: u64 = 20_000_000;

/// Largest rendered prompt, in bytes (several times a 128k-token context's worth of text, and
/// small enough that tokenizing it stays within a few hundred megabytes).
const MAX_OUTPUT_BYTES: usize = 16 << 20;

/// Largest template source, in bytes: real templates are a few kilobytes (the largest known, with
/// tool-use instructions, under 100 KB). A larger one is refused before it is compiled.
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;

/// Most memory one render may hold at once, in bytes, where the program counts it (with
/// [`crate::RenderBudgetAllocator`] as its global allocator): eight times the largest output.
pub const RENDER_MEMORY_BYTES: usize = 8 * MAX_OUTPUT_BYTES;

/// Longest a render may take (the fuel stops a loop; this also stops slow single steps).
pub const RENDER_TIME_LIMIT: Duration = Duration::from_secs(5);

/// Stack of the thread a render runs on: the main thread's usual 8 MiB, for deep templates.
const RENDER_STACK_BYTES: usize = 8 << 20;

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, or whatever roles the template knows.
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    source: String,
    fuel: u64,
    /// Most bytes one render's thread may hold (default [`RENDER_MEMORY_BYTES`]).
    memory_budget: usize,
    /// Set when a render passed its memory budget: its thread is stopped for good, and later
    /// renders are refused rather than stopping another.
    over_budget: AtomicBool,
}

/// ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), used by Qwen, SmolLM and many others.
const CHATML: &str = "{%- for message in messages -%}\n\
{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' -}}\n\
{%- endfor -%}\n\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// Gemma's turns (`<start_of_turn>user\n...<end_of_turn>\n`, the assistant's role named `model`),
/// with a system message folded into the first user turn, as Gemma 3's own template does.
const GEMMA: &str = "{{- bos_token -}}\n\
{%- if messages and messages[0].role == 'system' -%}\n\
{%- set first_prefix = messages[0].content ~ '\\n\\n' -%}\n\
{%- set turns = messages[1:] -%}\n\
{%- else -%}\n\
{%- set first_prefix = '' -%}\n\
{%- set turns = messages -%}\n\
{%- endif -%}\n\
{%- for message in turns -%}\n\
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}\n\
{{- raise_exception('conversation roles must alternate user/assistant/user/...') -}}\n\
{%- endif -%}\n\
{{- '<start_of_turn>' ~ ('model' if message.role == 'assistant' else message.role) ~ '\\n' -}}\n\
{{- (first_prefix if loop.first else '') ~ (message.content | trim) ~ '<end_of_turn>\\n' -}}\n\
{%- endfor -%}\n\
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}";

impl ChatTemplate {
    /// The template of a GGUF file (`tokenizer.chat_template`), if it has one.
    pub fn from_gguf(g: &ember_gguf::Gguf) -> Result<Option<ChatTemplate>, TokenizerError> {
        ChatTemplate::from_metadata(g.metadata())
    }

    /// The template in GGUF metadata, if there is one.
    pub fn from_metadata(
        md: &ember_gguf::Metadata,
    ) -> Result<Option<ChatTemplate>, TokenizerError> {
        md.get_str_opt("tokenizer.chat_template")?
            .map(ChatTemplate::from_source)
            .transpose()
    }

    /// Compiles a template from its Jinja source (for `--chat-template-file`).
    pub fn from_source(src: &str) -> Result<ChatTemplate, TokenizerError> {
        if src.len() > MAX_TEMPLATE_BYTES {
            return Err(TokenizerError::TemplateTooLarge {
                size: src.len(),
                max: MAX_TEMPLATE_BYTES,
            });
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(DEFAULT_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, src.to_owned())
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e, DEFAULT_FUEL)))?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            source: src.to_owned(),
            fuel: DEFAULT_FUEL,
            memory_budget: RENDER_MEMORY_BYTES,
            over_budget: AtomicBool::new(false),
        })
    }

    /// Sets how many instructions one render may execute (default [`DEFAULT_FUEL`]).
    pub fn with_fuel(mut self, fuel: u64) -> ChatTemplate {
        Arc::make_mut(&mut self.env).set_fuel(Some(fuel));
        self.fuel = fuel;
        self
    }

    /// Sets the most bytes one render's thread may hold where the program counts them (default
    /// [`RENDER_MEMORY_BYTES`]). A render past it is stopped for good, holding up to this much:
    /// a harness that renders many hostile templates in one process (the fuzz target) keeps it
    /// small so the stopped renders stay small.
    pub fn with_memory_budget(mut self, bytes: usize) -> ChatTemplate {
        self.memory_budget = bytes;
        self
    }

    /// A template this crate ships, by name: `chatml` or `gemma`. For models whose file has no
    /// template of its own.
    pub fn builtin(name: &str) -> Option<ChatTemplate> {
        let src = match name {
            "chatml" => CHATML,
            "gemma" => GEMMA,
            _ => return None,
        };
        ChatTemplate::from_source(src).ok()
    }

    /// The shipped template that fits a vocabulary, judged by its turn markers: `gemma` when it
    /// has `<start_of_turn>`, `chatml` when it has `<|im_start|>`.
    pub fn builtin_for(tokenizer: &Tokenizer) -> Option<ChatTemplate> {
        if tokenizer.token_id("<start_of_turn>").is_some() {
            ChatTemplate::builtin("gemma")
        } else if tokenizer.token_id("<|im_start|>").is_some() {
            ChatTemplate::builtin("chatml")
        } else {
            None
        }
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` into prompt text. `add_generation_prompt` appends the opening of the
    /// assistant's turn; `bos_token` and `eos_token` are the texts templates may insert.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, TokenizerError> {
        self.render_with(
            Value::from_serialize(messages),
            add_generation_prompt,
            bos_token,
            eos_token,
            &serde_json::Map::new(),
        )
    }

    /// Renders messages of any shape (OpenAI-style content parts, tool calls, ...) given as JSON,
    /// with extra template variables such as `tools`; `extra` cannot override `messages`,
    /// `add_generation_prompt`, `bos_token` or `eos_token`.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        self.render_with(
            Value::from_serialize(messages),
            add_generation_prompt,
            bos_token,
            eos_token,
            extra,
        )
    }

    /// Renders on a thread of its own, under the time limit and (where the program counts it)
    /// the memory budget; a render past either is abandoned and reported, any other is joined.
    fn render_with(
        &self,
        messages: Value,
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        let memory_budget = self.memory_budget;
        let over_budget = || {
            TokenizerError::TemplateRender(format!(
                "it built values over {memory_budget} bytes: expected a template that builds its prompt from the messages"
            ))
        };
        if self.over_budget.load(Ordering::Acquire) {
            return Err(over_budget());
        }
        let fixed = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        // Later contexts only fill in names the earlier ones lack.
        let ctx = minijinja::context! { ..fixed, ..Value::from_serialize(extra) };
        let env = Arc::clone(&self.env);
        let fuel = self.fuel;
        let budget = Arc::new(crate::budget::RenderBudget::new(memory_budget));
        let thread_budget = Arc::clone(&budget);
        let (sender, receiver) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("chat-template".into())
            .stack_size(RENDER_STACK_BYTES)
            .spawn(move || {
                crate::budget::set_current(Some(&thread_budget));
                let result = render_on(&env, ctx, fuel);
                crate::budget::set_current(None);
                let _ = sender.send(result);
            })
            .map_err(|e| {
                TokenizerError::TemplateRender(format!("cannot start its render thread: {e}"))
            })?;
        let start = Instant::now();
        loop {
            match receiver.recv_timeout(Duration::from_millis(10)) {
                // The thread ends right after sending: joined, it has freed all it held (the
                // fuzz target's leak check found a render thread still exiting after a run).
                Ok(result) => {
                    let _ = handle.join();
                    return result;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = handle.join();
                    return Err(TokenizerError::TemplateRender(
                        "its render thread ended without a result".into(),
                    ));
                }
                Err(RecvTimeoutError::Timeout) => {
                    if budget.exceeded() {
                        self.over_budget.store(true, Ordering::Release);
                        return Err(over_budget());
                    }
                    if start.elapsed() > RENDER_TIME_LIMIT {
                        return Err(TokenizerError::TemplateRender(format!(
                            "it ran for over {} s: expected a template that ends",
                            RENDER_TIME_LIMIT.as_secs()
                        )));
                    }
                }
            }
        }
    }
}

/// One render, on the calling thread: the output capped at [`MAX_OUTPUT_BYTES`].
fn render_on(env: &Environment<'static>, ctx: Value, fuel: u64) -> Result<String, TokenizerError> {
    let template = env
        .get_template(TEMPLATE_NAME)
        .map_err(|e| TokenizerError::TemplateRender(describe(&e, fuel)))?;
    {
        let mut out = LimitedWriter {
            bytes: Vec::new(),
            overflowed: false,
        };
        match template.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|e| TokenizerError::TemplateRender(format!("output is not UTF-8: {e}"))),
            Err(_) if out.overflowed => Err(TokenizerError::TemplateRender(format!(
                "output exceeds {MAX_OUTPUT_BYTES} bytes: expected a prompt below that size"
            ))),
            Err(e) => Err(TokenizerError::TemplateRender(describe(&e, fuel))),
        }
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("fuel", &self.fuel)
            .field("memory_budget", &self.memory_budget)
            .finish_non_exhaustive()
    }
}

/// The message of a minijinja error with its details and the template line.
fn describe(e: &Error, fuel: u64) -> String {
    let mut text = match e.kind() {
        // A template's own `raise_exception` message is the whole story.
        ErrorKind::InvalidOperation if e.name() == Some(TEMPLATE_NAME) && e.detail().is_some() => {
            format!("template error: {}", e.detail().unwrap_or_default())
        }
        ErrorKind::OutOfFuel => format!(
            "template ran out of fuel after {fuel} instructions: expected a template that ends"
        ),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        text.push_str(&format!(" (line {line})"));
    }
    text
}

/// Collects output and fails once it passes [`MAX_OUTPUT_BYTES`].
struct LimitedWriter {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl io::Write for LimitedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_OUTPUT_BYTES {
            self.overflowed = true;
            return Err(io::Error::other("chat template output too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC time formatted with C `strftime` directives (`%Y`,
/// `%m`, `%d`, `%H`, `%M`, `%S`, `%b`, `%B`, `%a`, `%A`, `%j`, `%y`, `%e`, `%I`, `%p`, `%%`).
/// Templates use it to put today's date in a system prompt.
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(format_utc(secs, &format))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// Formats seconds since the Unix epoch (UTC) with `strftime` directives; unknown directives are
/// kept as written.
fn format_utc(secs: u64, format: &str) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let (year, month, day) = civil_from_days(days);
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    // 1970-01-01 was a Thursday, the first entry of WEEKDAYS.
    let weekday = WEEKDAYS[(days % 7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Year, month (1-12) and day (1-31) of a count of days since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    // Shift the epoch to 0000-03-01 so that leap days fall at the end of each 400-year era.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153; // 0 = March
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Days since 1970-01-01 of a date (year >= 1970).
fn days_from_civil(year: u64, month: u64, day: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let year_of_era = y % 400;
    let month_index = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_format_like_strftime() {
        assert_eq!(
            format_utc(0, "%Y-%m-%d %H:%M:%S %a %A %b %B %j"),
            "1970-01-01 00:00:00 Thu Thursday Jan January 001"
        );
        // 2026-11-30 06:39:25 UTC, a Monday.
        assert_eq!(
            format_utc(1_796_020_765, "%d %b %Y, %A %I %p %%"),
            "30 Nov 2026, Monday 06 AM %"
        );
        // 2024-02-29, a leap day.
        assert_eq!(
            format_utc(1_709_164_800, "%Y-%m-%d %j %e"),
            "2024-02-29 060 29"
        );
        assert_eq!(format_utc(0, "%Q and %"), "%Q and %");
    }

    #[test]
    fn days_round_trip() {
        for days in [0u64, 59, 365, 10_957, 19_782, 20_422, 50_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
