//! Finds the line of a dotted field path in YAML text, for errors about rules that span fields
//! (the YAML parser already locates type and range errors itself).

/// Returns the 1-based line where `path` (e.g. `scheduler.policy.name` or
/// `server.api_keys[1].tier`) is written: in block-style YAML, or inside a flow mapping on one
/// line (`policy: { name: fcfs }`); `None` when it cannot be found (a flow mapping over several
/// lines, or a field that was left to its default).
pub fn locate(text: &str, path: &str) -> Option<usize> {
    locate_block(text, path)
        .or_else(|| locate_in_flow(text, path))
        .or_else(|| locate_in_flow_list(text, path))
}

/// The line of an item's field of a list written in flow style on one line (`api_keys: [{key:
/// k, tenant: a, tier: gold}]`, `adapter_dirs: [/srv/a, /srv/b]`), which has no `- ` items for
/// [`locate_block`] to count: the line of the list's key, when its `[` is on that line and the
/// rest of the path's keys are written after it, in order.
fn locate_in_flow_list(text: &str, path: &str) -> Option<usize> {
    let segments: Vec<&str> = path.split('.').collect();
    let at = segments.iter().position(|s| s.contains('['))?;
    let mut list = segments[..at].to_vec();
    list.push(segments[at].split('[').next().unwrap_or(segments[at]));
    let list = list.join(".");
    let line = locate_block(text, &list).or_else(|| locate_in_flow(text, &list))?;
    let written = text.lines().nth(line - 1)?;
    let written = written.split(" #").next().unwrap_or(written);
    let key = list.rsplit('.').next().unwrap_or(&list);
    let after_key = &written[find_key(written, key)? + key.len() + 1..];
    let mut rest = &after_key[after_key.find('[')?..];
    for seg in &segments[at + 1..] {
        let key = seg.split('[').next().unwrap_or(seg);
        let i = find_key(rest, key)?;
        rest = &rest[i + key.len()..];
    }
    Some(line)
}

/// The line of the nearest enclosing field of `path` written in block style, when the rest of
/// the path's keys are written on that same line, in order (a one-line flow mapping).
fn locate_in_flow(text: &str, path: &str) -> Option<usize> {
    let segments: Vec<&str> = path.split('.').collect();
    for n in (1..segments.len()).rev() {
        let Some(line) = locate_block(text, &segments[..n].join(".")) else {
            continue;
        };
        let written = text.lines().nth(line - 1)?;
        // Leave out a comment (` #` outside quotes is close enough for keys).
        let mut rest = written.split(" #").next().unwrap_or(written);
        for seg in &segments[n..] {
            let key = seg.split('[').next().unwrap_or(seg);
            let at = find_key(rest, key)?;
            rest = &rest[at + key.len()..];
        }
        return Some(line);
    }
    None
}

/// Where `key:` is written in `line` as a whole key (not the end of a longer one).
fn find_key(line: &str, key: &str) -> Option<usize> {
    let pattern = format!("{key}:");
    let mut from = 0;
    while let Some(i) = line[from..].find(&pattern) {
        let at = from + i;
        let before = line[..at].chars().next_back();
        if before.is_none_or(|c| matches!(c, '{' | ',' | ' ' | '\t' | '"' | '\'')) {
            return Some(at);
        }
        from = at + pattern.len();
    }
    None
}

/// [`locate`] in block style only. A segment's key is looked for below the previous
/// segment's line, among the lines indented more than it; the dash line of a list item is
/// the one exception (the item's first key sits on it), and the item ends at the next line
/// as little indented (the next item's dash, or the end of the list).
fn locate_block(text: &str, path: &str) -> Option<usize> {
    let mut parent_indent: Option<usize> = None;
    // The dash line of the list item the previous segment's index chose.
    let mut dash_line: Option<usize> = None;
    let mut start = 0usize;
    let lines: Vec<&str> = text.lines().collect();
    let mut found = None;
    for segment in path.split('.') {
        let (key, index) = match segment.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (segment, None),
        };
        let mut hit = None;
        for (i, line) in lines.iter().enumerate().skip(start) {
            let indent = line.len() - line.trim_start().len();
            let body = line.trim_start().trim_start_matches("- ");
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            if let Some(p) = parent_indent {
                if indent <= p && dash_line != Some(i) {
                    break;
                }
            }
            if body.starts_with(&format!("{key}:")) {
                hit = Some((i, indent));
                break;
            }
        }
        let (mut line_no, mut indent) = hit?;
        if let Some(n) = index {
            // Walk to the n-th `- ` item below the key: the dashes indented as the first one
            // (deeper ones are items of a list inside an item).
            let mut seen = 0usize;
            let mut item = None;
            let mut dash_indent = None;
            for (i, line) in lines.iter().enumerate().skip(line_no + 1) {
                let ind = line.len() - line.trim_start().len();
                if line.trim().is_empty() || line.trim_start().starts_with('#') {
                    continue;
                }
                let dash = line.trim_start().starts_with("- ");
                if (ind <= indent && !dash) || dash_indent.is_some_and(|d| ind < d) {
                    break;
                }
                if dash && *dash_indent.get_or_insert(ind) == ind {
                    if seen == n {
                        item = Some((i, ind));
                        break;
                    }
                    seen += 1;
                }
            }
            let (i, ind) = item?;
            line_no = i;
            indent = ind;
            // The item's first key sits on the dash line: let the next segment search from it,
            // down to the next line indented as little as the dash.
            start = line_no;
            parent_indent = Some(indent);
            dash_line = Some(line_no);
            found = Some(line_no + 1);
            continue;
        }
        start = line_no + 1;
        parent_indent = Some(indent);
        dash_line = None;
        found = Some(line_no + 1);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::locate;

    const TEXT: &str = "# comment\nserver:\n  port: 80\n  api_keys:\n    - key: aaaaaaaa\n      tenant: a\n    - key: bbbbbbbb\n      tier: gold\nscheduler:\n  policy:\n    name: x\n";

    #[test]
    fn finds_nested_keys() {
        assert_eq!(locate(TEXT, "server.port"), Some(3));
        assert_eq!(locate(TEXT, "scheduler.policy.name"), Some(11));
        assert_eq!(locate(TEXT, "scheduler"), Some(9));
    }

    #[test]
    fn finds_list_items() {
        assert_eq!(locate(TEXT, "server.api_keys[1].tier"), Some(8));
        assert_eq!(locate(TEXT, "server.api_keys[0].key"), Some(5));
    }

    #[test]
    fn finds_keys_of_one_line_flow_mappings() {
        let text = "scheduler:\n  max_num_seqs: 8\n  policy: { name: x, params: { token_budget: -1 } } # c\nlora: { max_loras: 0 }\n";
        assert_eq!(locate(text, "scheduler.policy.name"), Some(3));
        assert_eq!(
            locate(text, "scheduler.policy.params.token_budget"),
            Some(3)
        );
        assert_eq!(locate(text, "lora.max_loras"), Some(4));
        // Not written: no line, even though the enclosing mapping is found.
        assert_eq!(locate(text, "scheduler.policy.params.aging"), None);
        assert_eq!(locate(text, "lora.max_lora_rank"), None);
        assert_eq!(locate(text, "scheduler.policy.me"), None);
    }

    #[test]
    fn finds_fields_of_items_of_one_line_flow_lists() {
        let text = "server:\n  api_keys: [{key: aaaaaaaa, tenant: a}, {key: bbbbbbbb, tier: gold}]\nlora:\n  adapter_dirs: [/srv/a, /srv/b]  # c\n  adapters: [{name: x, path: /p}]\n";
        assert_eq!(locate(text, "server.api_keys[1].tier"), Some(2));
        assert_eq!(locate(text, "server.api_keys[0].key"), Some(2));
        assert_eq!(locate(text, "lora.adapter_dirs[1]"), Some(4));
        assert_eq!(locate(text, "lora.adapters[0].path"), Some(5));
        // A field no item writes, and a list whose `[` is on another line: no line.
        assert_eq!(locate(text, "server.api_keys[0].adapters"), None);
        let text = "server:\n  api_keys:\n    [{key: aaaaaaaa, tier: gold}]\n";
        assert_eq!(locate(text, "server.api_keys[0].tier"), None);
    }

    /// The line after a key is held to the key's indentation like every other: a key whose
    /// value is written on its own line (a flow mapping, a scalar) has nothing below it, and
    /// the next line's key of the same name is a sibling's, not the path's (it used to be
    /// taken, one line off).
    #[test]
    fn the_line_after_a_flow_mapping_is_not_inside_it() {
        let text = "scheduler:\n  policy: { name: x, params: { label: y } }\n  params: 1\n";
        assert_eq!(locate(text, "scheduler.policy.params"), Some(2));
        assert_eq!(locate(text, "scheduler.policy.params.label"), Some(2));
        let text = "lora: { max_loras: 0 }\nmax_loras: 1\n";
        assert_eq!(locate(text, "lora.max_loras"), Some(1));
        // Written nowhere under the key: no line, rather than the sibling's.
        let text = "tiers:\n  gold: {}\n  weight: 2\n";
        assert_eq!(locate(text, "tiers.gold.weight"), None);
        let text = "server:\n  port: 80\nhost: x\n";
        assert_eq!(locate(text, "server.port.host"), None);
    }

    /// Only a list item's dash line is exempt from its parent's indentation (its first key
    /// sits on it): a list item ends at the next dash, so an item written as a flow mapping
    /// does not lend the next item's field.
    #[test]
    fn a_list_item_ends_at_the_next_dash() {
        let text = "server:\n  api_keys:\n    - { key: aaaaaaaa, tier: gold }\n    - key: bbbbbbbb\n      tier: standard\n";
        assert_eq!(locate(text, "server.api_keys[0].tier"), Some(3));
        assert_eq!(locate(text, "server.api_keys[1].tier"), Some(5));
        assert_eq!(locate(text, "server.api_keys[0].key"), Some(3));
        // The dash at the key's own indentation, as YAML allows.
        let text = "server:\n  api_keys:\n  - key: aaaaaaaa\n  - key: bbbbbbbb\n    tier: gold\nlora: {}\n";
        assert_eq!(locate(text, "server.api_keys[0].tier"), None);
        assert_eq!(locate(text, "server.api_keys[1].tier"), Some(5));
        assert_eq!(locate(text, "server.api_keys[1].key"), Some(4));
    }

    /// The items of a list are its own dashes, not those of a list inside an item (an API
    /// key's `adapters` written in block style): item 1 is the second key, not the first
    /// key's second adapter.
    #[test]
    fn a_list_inside_an_item_lends_no_items() {
        let text = "server:\n  api_keys:\n    - key: aaaaaaaa\n      adapters:\n        - x\n        - y\n    - key: bbbbbbbb\n      tier: gold\n    - key: cccccccc\n";
        assert_eq!(locate(text, "server.api_keys[1].tier"), Some(8));
        assert_eq!(locate(text, "server.api_keys[1].key"), Some(7));
        assert_eq!(locate(text, "server.api_keys[2].key"), Some(9));
        assert_eq!(locate(text, "server.api_keys[0].adapters[1]"), Some(6));
        assert_eq!(locate(text, "server.api_keys[3].key"), None);
        // The dash at the key's own indentation, with an item's list below it.
        let text = "server:\n  api_keys:\n  - key: aaaaaaaa\n    adapters:\n    - x\n  - key: bbbbbbbb\n    tier: gold\n";
        assert_eq!(locate(text, "server.api_keys[1].tier"), Some(7));
        assert_eq!(locate(text, "server.api_keys[0].adapters[0]"), Some(5));
    }

    #[test]
    fn missing_fields_have_no_line() {
        assert_eq!(locate(TEXT, "cache.block_size"), None);
        assert_eq!(locate(TEXT, "server.host"), None);
    }
}
