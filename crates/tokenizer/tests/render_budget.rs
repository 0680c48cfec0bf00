//! The memory budget of chat-template renders, in a test binary whose global allocator counts
//! it (as the `ember` binary's does): a template that builds huge values without printing them
//! is stopped at its budget with an error naming the cause, and refused from then on; other
//! templates are unaffected.

use ember_tokenizer::{ChatMessage, ChatTemplate, RenderBudgetAllocator, RENDER_MEMORY_BYTES};

#[global_allocator]
static ALLOCATOR: RenderBudgetAllocator = RenderBudgetAllocator;

#[test]
fn a_template_building_huge_values_is_stopped_at_its_budget() {
    // 32 MB, then doubled until the last would be 1 GB; only its length is printed.
    let doubling = ChatTemplate::from_source(
        "{% set a = 'x' * 32000000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}\
         {% set e = d ~ d %}{% set f = e ~ e %}{{ f | length }}",
    )
    .unwrap();
    let expected =
        format!("chat template failed to render: it built values over {RENDER_MEMORY_BYTES} bytes");
    let error = doubling.render(&[], false, "", "").unwrap_err().to_string();
    assert!(error.starts_with(&expected), "{error}");
    // Its stopped render keeps its memory; the template is not run again.
    let error = doubling.render(&[], false, "", "").unwrap_err().to_string();
    assert!(error.starts_with(&expected), "{error}");

    // Values within the budget are fine, and so is any other template.
    let within =
        ChatTemplate::from_source("{% set a = 'x' * 8000000 %}{% set b = a ~ a %}{{ b | length }}")
            .unwrap();
    assert_eq!(within.render(&[], false, "", "").unwrap(), "16000000");
    let plain = ChatTemplate::from_source("{{ messages[0].content }}").unwrap();
    assert_eq!(
        plain
            .render(&[ChatMessage::new("user", "hi")], false, "", "")
            .unwrap(),
        "hi"
    );
}
