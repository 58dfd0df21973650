//! Reasoning read apart from the answer: models that think first (Qwen3, SmolLM3, QwQ) write
//! `<think>...</think>` before their answer; the text inside goes to the message's
//! `reasoning_content` (vLLM's field), the rest to `content`.
//!
//! Where the model opens the block itself (Qwen3, SmolLM3), a choice reasons only when its
//! output opens with `<think>` (after whitespace): a model whose thinking is switched off (Qwen3
//! with `enable_thinking: false`, whose template writes an empty block into the prompt) answers
//! directly, and all of it is content. Where the template's generation prompt opens the block
//! (QwQ, DeepSeek-R1, Qwen3's thinking-only models), the output is reasoning up to `</think>`
//! ([`ThinkStart::Prompt`]). The whitespace between `</think>` and the answer is dropped.
//! [`ThinkSplitter`] reads the text as it streams, holding back only what may be part of a tag.
//!
//! Mistral's reasoning models (Magistral) write `[THINK]...[/THINK]` instead
//! ([`MISTRAL_THINK_TAGS`]), special tokens of their tokenizers whose text the answer keeps for
//! the splitter, as it keeps tool-call markers.

use super::held::{leading_space, partial_tag, MAX_HELD_SPACE};

/// Who opens the `<think>` block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkStart {
    /// The model writes `<think>` (or answers directly).
    Model,
    /// The chat template's generation prompt ends with `<think>`: the output starts inside.
    Prompt,
}

/// Opens the reasoning.
pub const THINK_OPEN: &str = "<think>";
/// Closes the reasoning.
pub const THINK_CLOSE: &str = "</think>";

/// The tags a model writes its reasoning between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkTags {
    /// Opens the reasoning.
    pub open: &'static str,
    /// Closes it.
    pub close: &'static str,
}

/// `<think>...</think>` (Qwen3, SmolLM3, QwQ, DeepSeek-R1).
pub const THINK_TAGS: ThinkTags = ThinkTags {
    open: THINK_OPEN,
    close: THINK_CLOSE,
};

/// `[THINK]...[/THINK]` (Mistral's Magistral).
pub const MISTRAL_THINK_TAGS: ThinkTags = ThinkTags {
    open: "[THINK]",
    close: "[/THINK]",
};

impl ThinkTags {
    /// The tags a chat template writes: Mistral's when it mentions `[THINK]`, `<think>` when
    /// it mentions that, else none.
    pub fn for_template(source: &str) -> Option<Self> {
        if source.contains(MISTRAL_THINK_TAGS.open) {
            Some(MISTRAL_THINK_TAGS)
        } else if source.contains(THINK_OPEN) {
            Some(THINK_TAGS)
        } else {
            None
        }
    }

    /// Whether a rendered prompt ends inside an opened block (its generation prompt opened it).
    pub fn ends_inside(self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(self.open)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first character that is not whitespace: `<think>` may open.
    Start,
    /// Inside the reasoning.
    Reasoning,
    /// After `</think>`, before the answer's first character that is not whitespace.
    After,
    /// The answer, passed through.
    Content,
}

/// What one piece of text read gives: reasoning and answer text, in that order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    /// Text of the reasoning.
    pub reasoning: String,
    /// Text of the answer.
    pub content: String,
}

/// Reads one choice's generated text into reasoning and answer, in pieces as it streams.
#[derive(Debug)]
pub struct ThinkSplitter {
    state: State,
    /// Text read and not given out yet.
    held: String,
    /// Whether the output opened with `<think>`.
    reasoned: bool,
    /// The tags.
    tags: ThinkTags,
}

impl ThinkSplitter {
    /// A splitter at the start of a choice whose block `start` opens.
    pub fn new(start: ThinkStart) -> Self {
        Self::with_tags(start, THINK_TAGS)
    }

    /// A splitter for reasoning between `tags`.
    pub fn with_tags(start: ThinkStart, tags: ThinkTags) -> Self {
        let prompt = start == ThinkStart::Prompt;
        Self {
            state: if prompt {
                State::Reasoning
            } else {
                State::Start
            },
            held: String::new(),
            reasoned: prompt,
            tags,
        }
    }

    /// Whether the output opened with `<think>` (so the message has a `reasoning_content`).
    pub fn reasoned(&self) -> bool {
        self.reasoned
    }

    /// Takes the next generated text; returns what is known from it.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        if self.state == State::Content {
            out.content.push_str(text);
            return out;
        }
        self.held.push_str(text);
        self.pump(&mut out, false);
        out
    }

    /// The end of the choice: what was held back comes out (a reasoning cut short stays
    /// reasoning).
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        self.pump(&mut out, true);
        out
    }

    fn pump(&mut self, out: &mut Split, last: bool) {
        loop {
            match self.state {
                State::Start => {
                    let space = leading_space(&self.held);
                    let rest = &self.held[space..];
                    let open = self.tags.open;
                    if space <= MAX_HELD_SPACE && rest.starts_with(open) {
                        self.held.drain(..space + open.len());
                        self.reasoned = true;
                        self.state = State::Reasoning;
                        continue;
                    }
                    let undecided = space <= MAX_HELD_SPACE && open.starts_with(rest);
                    if undecided && !last {
                        return;
                    }
                    self.state = State::Content;
                    out.content.push_str(&std::mem::take(&mut self.held));
                    return;
                }
                State::Reasoning => {
                    let close = self.tags.close;
                    if let Some(at) = self.held.find(close) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + close.len());
                        self.state = State::After;
                        continue;
                    }
                    let keep = if last {
                        0
                    } else {
                        partial_tag(&self.held, close)
                    };
                    let rest = self.held.split_off(self.held.len() - keep);
                    out.reasoning
                        .push_str(&std::mem::replace(&mut self.held, rest));
                    return;
                }
                State::After => {
                    let space = leading_space(&self.held);
                    if space == self.held.len() && space <= MAX_HELD_SPACE {
                        if last {
                            self.held.clear();
                        }
                        return;
                    }
                    if space <= MAX_HELD_SPACE {
                        self.held.drain(..space);
                    }
                    self.state = State::Content;
                    out.content.push_str(&std::mem::take(&mut self.held));
                    return;
                }
                State::Content => {
                    out.content.push_str(&std::mem::take(&mut self.held));
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `chunks` as one stream: (reasoning, content, reasoned).
    fn read(chunks: &[&str]) -> (String, String, bool) {
        read_from(ThinkStart::Model, chunks)
    }

    fn read_from(start: ThinkStart, chunks: &[&str]) -> (String, String, bool) {
        let mut s = ThinkSplitter::new(start);
        let (mut reasoning, mut content) = (String::new(), String::new());
        for c in chunks {
            let split = s.push(c);
            reasoning.push_str(&split.reasoning);
            content.push_str(&split.content);
        }
        let split = s.finish();
        reasoning.push_str(&split.reasoning);
        content.push_str(&split.content);
        (reasoning, content, s.reasoned())
    }

    #[test]
    fn reasoning_and_answer_come_apart_however_the_text_is_cut() {
        let long = " ".repeat(300);
        let far = format!("{long}<think>a</think>");
        // (text, reasoning, content, whether it reasoned)
        let cases: Vec<(String, &str, String, bool)> = vec![
            (
                "<think>\nThe user greets me. ✓\n</think>\n\nHello! ✓".into(),
                "\nThe user greets me. ✓\n",
                "Hello! ✓".into(),
                true,
            ),
            ("\n <think>a</think>b".into(), "a", "b".into(), true),
            // Cut short while thinking: all reasoning.
            (
                "<think>still thinking </thi".into(),
                "still thinking </thi",
                String::new(),
                true,
            ),
            ("<think></think>".into(), "", String::new(), true),
            // No block at the start: all content, whitespace and all.
            (
                "\n\nHello <think>x</think>".into(),
                "",
                "\n\nHello <think>x</think>".into(),
                false,
            ),
            ("<thin".into(), "", "<thin".into(), false),
            ("<thinking>".into(), "", "<thinking>".into(), false),
            (String::new(), "", String::new(), false),
            // A second block is the answer's text.
            (
                "<think>a</think>b<think>c</think>".into(),
                "a",
                "b<think>c</think>".into(),
                true,
            ),
            // Too much whitespace before the tag, or after the block: content.
            (far.clone(), "", far, false),
            (
                format!("<think>a</think>{long}b"),
                "a",
                format!("{long}b"),
                true,
            ),
        ];
        for (text, reasoning, content, reasoned) in cases {
            let want = (reasoning.to_string(), content, reasoned);
            for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
                assert_eq!(
                    read(&[&text[..cut], &text[cut..]]),
                    want,
                    "{text:?} cut at {cut}"
                );
            }
            let chars: Vec<String> = text.chars().map(String::from).collect();
            let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
            assert_eq!(read(&refs), want, "{text:?} by chars");
        }
    }

    /// Mistral's tags (Magistral) come apart the same way, whatever the cuts; `<think>` is
    /// text to them.
    #[test]
    fn mistral_tags_come_apart_however_the_text_is_cut() {
        let read_tags = |start: ThinkStart, chunks: &[&str]| {
            let mut s = ThinkSplitter::with_tags(start, MISTRAL_THINK_TAGS);
            let (mut reasoning, mut content) = (String::new(), String::new());
            let mut splits: Vec<Split> = chunks.iter().map(|c| s.push(c)).collect();
            splits.push(s.finish());
            for c in splits {
                reasoning.push_str(&c.reasoning);
                content.push_str(&c.content);
            }
            (reasoning, content, s.reasoned())
        };
        let cases = [
            (
                ThinkStart::Model,
                "[THINK]Red or blue ✓?[/THINK]Red.",
                "Red or blue ✓?",
                "Red.",
                true,
            ),
            (ThinkStart::Model, " [THINK]a[/THINK]\n\nb", "a", "b", true),
            (
                ThinkStart::Model,
                "<think>a</think>b",
                "",
                "<think>a</think>b",
                false,
            ),
            (ThinkStart::Model, "[THINK]cut [/THI", "cut [/THI", "", true),
            (ThinkStart::Prompt, "hmm[/THINK]Yes.", "hmm", "Yes.", true),
        ];
        for (start, text, reasoning, content, reasoned) in cases {
            let want = (reasoning.to_string(), content.to_string(), reasoned);
            for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
                assert_eq!(
                    read_tags(start, &[&text[..cut], &text[cut..]]),
                    want,
                    "{text:?} cut at {cut}"
                );
            }
        }
        assert_eq!(
            ThinkTags::for_template("{{- '[THINK]' }}<think>"),
            Some(MISTRAL_THINK_TAGS)
        );
        assert_eq!(ThinkTags::for_template("<think>"), Some(THINK_TAGS));
        assert_eq!(ThinkTags::for_template("{{ messages }}"), None);
        assert!(MISTRAL_THINK_TAGS.ends_inside("[INST]x[/INST][THINK]\n"));
        assert!(!THINK_TAGS.ends_inside("[INST]x[/INST][THINK]"));
    }

    #[test]
    fn a_block_the_prompt_opened_is_reasoning_up_to_its_end() {
        let text = "\nHmm, red ✓.\n</think>\n\nRed.";
        for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
            assert_eq!(
                read_from(ThinkStart::Prompt, &[&text[..cut], &text[cut..]]),
                ("\nHmm, red ✓.\n".into(), "Red.".into(), true),
                "cut at {cut}"
            );
        }
        // Cut short while thinking: all reasoning; a second opening tag is reasoning's text.
        assert_eq!(
            read_from(ThinkStart::Prompt, &["<think>still"]),
            ("<think>still".into(), String::new(), true)
        );
    }

    #[test]
    fn only_a_possible_tag_is_held_back() {
        let mut s = ThinkSplitter::new(ThinkStart::Model);
        assert_eq!(s.push(" <thi"), Split::default());
        let split = s.push("nk>I wonder</th");
        assert_eq!(split.reasoning, "I wonder");
        assert_eq!(s.push("ink>\n").reasoning, "");
        let split = s.push("\nYes.");
        assert_eq!(
            (split.reasoning.as_str(), split.content.as_str()),
            ("", "Yes.")
        );
        assert_eq!(s.push(" More").content, " More");
        assert_eq!(s.finish(), Split::default());
    }
}
