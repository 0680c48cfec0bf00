//! Turning a conversation into the token ids a model reads: choosing the chat template (a file
//! the user gives, else the model's own, else a shipped one that fits the vocabulary), rendering
//! the messages with the assistant's turn opened, and tokenizing the result with special tokens
//! added and parsed, as llama.cpp does. Plain (non-chat) prompts are tokenized the same way,
//! without a template.

use std::path::{Path, PathBuf};

use ember_gguf::Gguf;
use ember_tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};

/// Where a chat template came from, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateOrigin {
    /// A file given by the user (`--chat-template-file`).
    File(PathBuf),
    /// The model's `tokenizer.chat_template`.
    Model,
}

impl std::fmt::Display for TemplateOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TemplateOrigin::File(path) => write!(f, "{}", path.display()),
            TemplateOrigin::Model => f.write_str("in the model"),
        }
    }
}

/// Why a conversation could not be turned into a prompt.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// Neither the user, nor the model, nor a shipped template that fits the vocabulary gives a
    /// template.
    #[error("the model has no chat template: pass one with --chat-template-file")]
    NoTemplate,
    /// The template file could not be read (or is not a regular file of at most
    /// [`crate::limits::MAX_TEMPLATE_FILE_BYTES`]).
    #[error("cannot read the chat template file")]
    TemplateUnreadable(#[source] crate::limits::FileError),
    /// The template does not compile (or the model's template metadata is not a string).
    #[error("bad chat template {origin}")]
    TemplateInvalid {
        origin: TemplateOrigin,
        #[source]
        source: TokenizerError,
    },
    /// The template failed while rendering (a `raise_exception` call, exhausted fuel, ...).
    #[error("cannot render the chat template")]
    RenderFailed(#[source] TokenizerError),
}

/// The chat template to use: the file when one is given, else the model's own, else the shipped
/// template that fits the tokenizer's turn markers, else `None`.
pub fn resolve_template(
    gguf: &Gguf,
    tokenizer: &Tokenizer,
    template_file: Option<&Path>,
) -> Result<Option<ChatTemplate>, ChatError> {
    if let Some(path) = template_file {
        let source = crate::limits::read_text_file(path, crate::limits::MAX_TEMPLATE_FILE_BYTES)
            .map_err(ChatError::TemplateUnreadable)?;
        let template =
            ChatTemplate::from_source(&source).map_err(|source| ChatError::TemplateInvalid {
                origin: TemplateOrigin::File(path.to_owned()),
                source,
            })?;
        return Ok(Some(template));
    }
    let own = ChatTemplate::from_gguf(gguf).map_err(|source| ChatError::TemplateInvalid {
        origin: TemplateOrigin::Model,
        source,
    })?;
    Ok(own.or_else(|| ChatTemplate::builtin_for(tokenizer)))
}

/// The token ids of a conversation with the assistant's turn opened, ready to generate the
/// reply: rendered through `template`, then tokenized with special tokens added and parsed.
/// `None` for the template is [`ChatError::NoTemplate`].
pub fn prompt_ids(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    messages: &[ChatMessage],
) -> Result<Vec<u32>, ChatError> {
    let template = template.ok_or(ChatError::NoTemplate)?;
    let token_text = |id: Option<u32>| id.and_then(|t| tokenizer.token_text(t)).unwrap_or("");
    let bos = token_text(tokenizer.bos());
    let eos = token_text(tokenizer.eos());
    let rendered = template
        .render(messages, true, bos, eos)
        .map_err(ChatError::RenderFailed)?;
    // Templates often write the BOS text themselves; tokenizing with special tokens added would
    // then give two BOS tokens, so the template's copy is dropped (llama.cpp does the same).
    let text = match rendered.strip_prefix(bos) {
        Some(rest) if tokenizer.add_bos() && !bos.is_empty() => rest,
        _ => rendered.as_str(),
    };
    Ok(tokenizer.encode(text, true, true))
}

/// A multi-turn conversation as `ember chat` keeps it: the system message and every turn, so
/// each new prompt is the whole history rendered through the template (the engine's prefix
/// cache then reuses the KV blocks of what was already read).
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    system: Option<String>,
    turns: Vec<ChatMessage>,
}

/// One line typed at the chat prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatInput {
    /// A message to answer.
    Message(String),
    /// `/reset`: forget the history (the system message stays).
    Reset,
    /// `/exit` (or `/quit`).
    Exit,
    /// `/help` (or `/?`).
    Help,
    /// Another `/word`.
    Unknown(String),
    /// A blank line.
    Empty,
}

/// The commands the chat prompt knows, for `/help`.
pub const CHAT_COMMANDS: &str = "/reset forgets the conversation, /exit ends it (Ctrl-D too), /help shows this; Ctrl-C stops an answer";

impl ChatInput {
    /// Reads one line of input. A line starting with `/` is a command; `//` starts a message
    /// with a literal `/`.
    pub fn parse(line: &str) -> ChatInput {
        let line = line.trim_end_matches(['\r', '\n']);
        if line.trim().is_empty() {
            return ChatInput::Empty;
        }
        if let Some(rest) = line.strip_prefix("//") {
            return ChatInput::Message(format!("/{rest}"));
        }
        match line.trim() {
            "/reset" | "/clear" => ChatInput::Reset,
            "/exit" | "/quit" | "/bye" => ChatInput::Exit,
            "/help" | "/?" => ChatInput::Help,
            other if other.starts_with('/') => ChatInput::Unknown(other.to_string()),
            _ => ChatInput::Message(line.to_string()),
        }
    }
}

impl Conversation {
    pub fn new(system: Option<String>) -> Conversation {
        Conversation {
            system,
            turns: Vec::new(),
        }
    }

    /// Forgets every turn; the system message stays.
    pub fn reset(&mut self) {
        self.turns.clear();
    }

    /// The messages to render for the next answer: the system message, the turns so far, and
    /// `user` as the last one.
    pub fn with_user(&self, user: &str) -> Vec<ChatMessage> {
        let mut messages: Vec<ChatMessage> = self
            .system
            .iter()
            .map(|s| ChatMessage::new("system", s.as_str()))
            .collect();
        messages.extend(self.turns.iter().cloned());
        messages.push(ChatMessage::new("user", user));
        messages
    }

    /// Records a finished (or stopped) exchange.
    pub fn push(&mut self, user: &str, assistant: &str) {
        self.turns.push(ChatMessage::new("user", user));
        self.turns.push(ChatMessage::new("assistant", assistant));
    }

    /// Exchanges kept.
    pub fn n_exchanges(&self) -> usize {
        self.turns.len() / 2
    }
}

/// What makes chatting with this model doubtful, as a warning to show before a chat: it carries
/// no chat template of its own (a shipped one that fits its turn markers is used, or none), or
/// its name says it is a base model, not one tuned to follow a conversation.
pub fn chat_warning(gguf: &Gguf) -> Option<String> {
    let metadata = gguf.metadata();
    let text = |key: &str| metadata.get_str_opt(key).ok().flatten().unwrap_or("");
    let names = [
        text("general.name"),
        text("general.finetune"),
        text("general.basename"),
    ];
    let says_base = names.iter().any(|n| {
        n.to_ascii_lowercase()
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|word| word == "base")
    });
    let has_template = metadata.get("tokenizer.chat_template").is_some();
    match (has_template, says_base) {
        (_, true) => Some(format!(
            "this looks like a base model ({:?}): base models are not tuned for chat and may not follow the conversation; an instruct or chat version answers better",
            names.iter().find(|n| !n.is_empty()).copied().unwrap_or("")
        )),
        (false, false) => Some(
            "the model carries no chat template of its own, so it may not be tuned for chat; the shipped template that matches its turn markers is used (--chat-template-file picks another)".into(),
        ),
        (true, false) => None,
    }
}

/// The token ids of a plain prompt (no chat template): special tokens added (BOS, when the
/// model wants one) and special-token texts in the prompt parsed as those tokens.
pub fn plain_prompt_ids(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, true, true)
}

#[cfg(test)]
mod conversation_tests {
    use super::*;

    #[test]
    fn input_lines_are_commands_or_messages() {
        let check = |line: &str, expected: ChatInput| {
            assert_eq!(ChatInput::parse(line), expected, "{line:?}")
        };
        check("/reset\n", ChatInput::Reset);
        check("  /exit ", ChatInput::Exit);
        check("/quit", ChatInput::Exit);
        check("/help", ChatInput::Help);
        check("/nope", ChatInput::Unknown("/nope".into()));
        check("//etc/passwd", ChatInput::Message("/etc/passwd".into()));
        check("hello there\r\n", ChatInput::Message("hello there".into()));
        check("   \n", ChatInput::Empty);
    }

    #[test]
    fn the_history_is_rendered_whole_and_reset_keeps_the_system_message() {
        let mut c = Conversation::new(Some("be brief".into()));
        c.push("hi", "hello");
        let roles: Vec<String> = c
            .with_user("again")
            .iter()
            .map(|m| format!("{}:{}", m.role, m.content))
            .collect();
        assert_eq!(
            roles,
            [
                "system:be brief",
                "user:hi",
                "assistant:hello",
                "user:again"
            ]
        );
        assert_eq!(c.n_exchanges(), 1);
        c.reset();
        let roles: Vec<String> = c.with_user("x").iter().map(|m| m.role.clone()).collect();
        assert_eq!(roles, ["system", "user"]);
    }
}

#[cfg(test)]
mod tests {
    use ember_gguf::{GgufWriter, Value};
    use ember_tokenizer::TokenizerSpec;

    use super::*;

    /// Special tokens of the test vocabulary, at ids 0..
    const SPECIALS: [&str; 4] = ["<s>", "</s>", "<|turn|>", "<|end|>"];
    const BOS: u32 = 0;
    const EOS: u32 = 1;
    const TURN: u32 = 2;
    const END: u32 = 3;

    /// GPT-2's byte-to-character map: printable bytes stand for themselves, the others are
    /// shifted to code points from 256 on, in byte order.
    fn byte_char(byte: u8) -> char {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable(byte) {
            return char::from(byte);
        }
        let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
        char::from_u32(256 + shifted).unwrap()
    }

    /// A byte-level BPE vocabulary with no merges: the special tokens (and `extra_special`, when
    /// given, after them), then one token per byte, so every byte of ordinary text is one token.
    fn tokenizer_of(add_bos: bool, extra_special: Option<&str>) -> Tokenizer {
        let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
        tokens.extend(extra_special.map(str::to_string));
        let n_special = tokens.len();
        tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
        let mut token_types = vec![1; tokens.len()];
        token_types[..n_special].fill(3);
        Tokenizer::from_spec(&TokenizerSpec {
            model: "gpt2".into(),
            pre: Some("gpt-2".into()),
            tokens,
            token_types: Some(token_types),
            merges: Some(Vec::new()),
            bos: Some(BOS),
            eos: Some(EOS),
            add_bos: Some(add_bos),
            ..TokenizerSpec::default()
        })
        .unwrap()
    }

    /// The test vocabulary: no turn markers that a shipped template would recognise.
    fn tokenizer(add_bos: bool) -> Tokenizer {
        tokenizer_of(add_bos, None)
    }

    /// The ids of ordinary text in the test vocabulary: one per byte.
    fn bytes(text: &str) -> Vec<u32> {
        text.bytes()
            .map(|b| SPECIALS.len() as u32 + u32::from(b))
            .collect()
    }

    /// A template that writes the BOS text itself, one turn per message, and opens the
    /// assistant's turn.
    const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|turn|>{{ m.role }}:{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|turn|>assistant:{% endif %}";

    fn template() -> ChatTemplate {
        ChatTemplate::from_source(TEMPLATE).unwrap()
    }

    fn conversation() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "be brief"),
            ChatMessage::new("user", "hi"),
            ChatMessage::new("assistant", "hello"),
            ChatMessage::new("user", "bye"),
        ]
    }

    /// The ids of [`conversation`] rendered by [`TEMPLATE`], without the leading BOS.
    fn conversation_ids() -> Vec<u32> {
        let mut ids = Vec::new();
        for (role, content) in [
            ("system", "be brief"),
            ("user", "hi"),
            ("assistant", "hello"),
            ("user", "bye"),
        ] {
            ids.push(TURN);
            ids.extend(bytes(&format!("{role}:{content}")));
            ids.push(END);
        }
        ids.push(TURN);
        ids.extend(bytes("assistant:"));
        ids
    }

    #[test]
    fn a_conversation_renders_every_turn_and_opens_the_assistant_turn() {
        let tokenizer = tokenizer(true);
        let ids = prompt_ids(&tokenizer, Some(&template()), &conversation()).unwrap();
        let mut expected = vec![BOS];
        expected.extend(conversation_ids());
        assert_eq!(ids, expected);
    }

    #[test]
    fn the_template_bos_is_dropped_only_when_the_tokenizer_adds_one() {
        // The tokenizer adds BOS: the template's copy goes, so there is exactly one.
        let adds_bos = tokenizer(true);
        let ids = prompt_ids(&adds_bos, Some(&template()), &conversation()).unwrap();
        assert_eq!(ids.iter().filter(|&&id| id == BOS).count(), 1);
        // The tokenizer adds none: the template's BOS text is kept and parsed as the token.
        let no_bos = tokenizer(false);
        let ids = prompt_ids(&no_bos, Some(&template()), &conversation()).unwrap();
        let mut expected = vec![BOS];
        expected.extend(conversation_ids());
        assert_eq!(ids, expected);
        // A template without the BOS text gets the tokenizer's one only.
        let without_bos = ChatTemplate::from_source(&TEMPLATE["{{ bos_token }}".len()..]).unwrap();
        let ids = prompt_ids(&adds_bos, Some(&without_bos), &conversation()).unwrap();
        let mut expected = vec![BOS];
        expected.extend(conversation_ids());
        assert_eq!(ids, expected);
        let ids = prompt_ids(&no_bos, Some(&without_bos), &conversation()).unwrap();
        assert_eq!(ids, conversation_ids());
    }

    #[test]
    fn plain_prompts_add_bos_and_parse_special_tokens() {
        let adds_bos = tokenizer(true);
        let mut expected = vec![BOS];
        expected.extend(bytes("a"));
        expected.push(END);
        expected.extend(bytes("b"));
        assert_eq!(plain_prompt_ids(&adds_bos, "a<|end|>b"), expected);
        assert_eq!(
            plain_prompt_ids(&tokenizer(false), "ab"),
            bytes("ab"),
            "no BOS when the tokenizer adds none"
        );
    }

    #[test]
    fn no_template_asks_for_a_template_file() {
        let error = prompt_ids(&tokenizer(true), None, &conversation()).unwrap_err();
        assert!(matches!(error, ChatError::NoTemplate), "{error:?}");
        assert_eq!(
            error.to_string(),
            "the model has no chat template: pass one with --chat-template-file"
        );
    }

    #[test]
    fn a_failing_render_is_a_render_error() {
        let failing =
            ChatTemplate::from_source("{{ raise_exception('roles must alternate') }}").unwrap();
        let error = prompt_ids(&tokenizer(true), Some(&failing), &conversation()).unwrap_err();
        assert!(matches!(error, ChatError::RenderFailed(_)), "{error:?}");
        let source = std::error::Error::source(&error).unwrap().to_string();
        assert!(source.contains("roles must alternate"), "{source}");
    }

    /// A GGUF file holding only metadata, with `chat_template` as its template when given.
    fn gguf(chat_template: Option<Value>) -> Gguf {
        let mut writer = GgufWriter::new();
        writer.metadata("general.architecture", Value::String("llama".into()));
        if let Some(template) = chat_template {
            writer.metadata("tokenizer.chat_template", template);
        }
        Gguf::from_bytes(writer.to_bytes()).unwrap()
    }

    #[test]
    fn chatting_with_a_base_model_or_one_without_template_is_flagged() {
        let template = || Some(Value::String("{{ messages }}".into()));
        assert_eq!(chat_warning(&gguf(template())), None);
        let e = chat_warning(&gguf(None)).unwrap();
        assert!(e.contains("no chat template of its own"), "{e}");
        for (key, name) in [
            ("general.name", "SmolLM2 135M Base"),
            ("general.finetune", "base"),
            ("general.basename", "Llama-3-8B-base"),
        ] {
            let mut writer = GgufWriter::new();
            writer.metadata("general.architecture", Value::String("llama".into()));
            writer.metadata(key, Value::String(name.into()));
            writer.metadata("tokenizer.chat_template", template().unwrap());
            let e = chat_warning(&Gguf::from_bytes(writer.to_bytes()).unwrap()).unwrap();
            assert!(
                e.contains("looks like a base model") && e.contains(name),
                "{e}"
            );
        }
        // "base" inside a word is not a base model.
        let mut writer = GgufWriter::new();
        writer.metadata(
            "general.name",
            Value::String("Database Coder Instruct".into()),
        );
        writer.metadata("tokenizer.chat_template", template().unwrap());
        assert_eq!(
            chat_warning(&Gguf::from_bytes(writer.to_bytes()).unwrap()),
            None
        );
    }

    fn render(template: &ChatTemplate) -> String {
        template
            .render(&[ChatMessage::new("user", "x")], true, "", "")
            .unwrap()
    }

    #[test]
    fn a_template_file_comes_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("template.jinja");
        std::fs::write(&path, "file:{{ messages[0].content }}").unwrap();
        let model = gguf(Some(Value::String("model".into())));
        let template = resolve_template(&model, &tokenizer(true), Some(&path))
            .unwrap()
            .unwrap();
        assert_eq!(render(&template), "file:x");
    }

    #[test]
    fn the_model_template_comes_before_the_shipped_ones() {
        let model = gguf(Some(Value::String(
            "model:{{ messages[0].content }}".into(),
        )));
        let template = resolve_template(&model, &tokenizer(true), None)
            .unwrap()
            .unwrap();
        assert_eq!(render(&template), "model:x");
    }

    #[test]
    fn a_shipped_template_serves_a_model_without_one_when_the_vocabulary_fits() {
        let chatml = tokenizer_of(true, Some("<|im_start|>"));
        let template = resolve_template(&gguf(None), &chatml, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            render(&template),
            "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
        );
        let unknown = tokenizer(true);
        assert!(resolve_template(&gguf(None), &unknown, None)
            .unwrap()
            .is_none());
    }

    #[test]
    fn template_errors_name_where_the_template_came_from() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.jinja");
        let tokenizer = tokenizer(true);
        let error = resolve_template(&gguf(None), &tokenizer, Some(&missing)).unwrap_err();
        assert!(
            matches!(error, ChatError::TemplateUnreadable(_)),
            "{error:?}"
        );
        assert_eq!(error.to_string(), "cannot read the chat template file");
        let cause = std::error::Error::source(&error).unwrap().to_string();
        assert!(
            cause.starts_with(&format!("cannot read {}: ", missing.display())),
            "{cause}"
        );
        let error = resolve_template(&gguf(None), &tokenizer, Some(dir.path())).unwrap_err();
        let cause = std::error::Error::source(&error).unwrap().to_string();
        assert!(
            cause.ends_with("expected a regular file, found a directory"),
            "{cause}"
        );

        let broken = dir.path().join("broken.jinja");
        std::fs::write(&broken, "{% for %}").unwrap();
        let error = resolve_template(&gguf(None), &tokenizer, Some(&broken)).unwrap_err();
        assert!(
            matches!(error, ChatError::TemplateInvalid { .. }),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            format!("bad chat template {}", broken.display())
        );

        let model = gguf(Some(Value::String("{% if %}".into())));
        let error = resolve_template(&model, &tokenizer, None).unwrap_err();
        assert_eq!(error.to_string(), "bad chat template in the model");
        let model = gguf(Some(Value::U32(7)));
        let error = resolve_template(&model, &tokenizer, None).unwrap_err();
        assert!(
            matches!(
                error,
                ChatError::TemplateInvalid {
                    origin: TemplateOrigin::Model,
                    ..
                }
            ),
            "a template that is not a string: {error:?}"
        );
    }
}
