//! Function lengths, read from the source: comments and string literals blanked (their lines
//! kept), test code left out (`#[cfg(test)]` items and modules), then each named `fn` with a
//! body measured from its `fn` line to its closing brace.

/// `text` with comments (line, block, nested block) and the contents of string and character
/// literals (plain, raw, byte) replaced by spaces, newlines kept: braces inside them no longer
/// count, and line numbers stay those of the file.
pub fn blank_comments_and_strings(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let ident_before = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            continue;
        }
        // Raw strings: r"..", r#".."#, br#".."#.
        let raw_at = match (c, next) {
            ('r', Some('"' | '#')) if !ident_before => Some(i + 1),
            ('b', Some('r')) if !ident_before && matches!(chars.get(i + 2), Some('"' | '#')) => {
                Some(i + 2)
            }
            _ => None,
        };
        if let Some(mut j) = raw_at {
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) == Some(&'"') {
                out.extend(std::iter::repeat_n(' ', j + 1 - i));
                i = j + 1;
                while i < chars.len() {
                    let closes =
                        chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#'));
                    if closes {
                        out.extend(std::iter::repeat_n(' ', hashes + 1));
                        i += hashes + 1;
                        break;
                    }
                    blank(&mut out, chars[i]);
                    i += 1;
                }
                continue;
            }
        }
        if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
                if i < chars.len() {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
            continue;
        }
        // A character literal ('x', '\n', '\u{..}', '{'), not a lifetime ('a).
        if c == '\'' {
            let end = if next == Some('\\') {
                (i + 2..chars.len().min(i + 12)).find(|&k| chars[k] == '\'')
            } else {
                (chars.get(i + 2) == Some(&'\'')).then_some(i + 2)
            };
            if let Some(end) = end {
                out.extend(std::iter::repeat_n(' ', end + 1 - i));
                i = end + 1;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    out
}

/// The index of the brace closing the one at `open` in `code` (blanked), or `None`.
fn closing(code: &[char], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, &c) in code.iter().enumerate().skip(open) {
        if c == '{' {
            depth += 1;
        } else if c == '}' {
            depth -= 1;
            if depth == 0 {
                return Some(k);
            }
        }
    }
    None
}

/// Where the item after `from` in `code` opens its body: the first `{` outside parentheses
/// and brackets, or `None` when a `;` ends it first (a declaration without a body).
fn body_start(code: &[char], from: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (k, &c) in code.iter().enumerate().skip(from) {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '{' if depth <= 0 => return Some(k),
            ';' if depth <= 0 => return None,
            _ => {}
        }
    }
    None
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `code` (blanked) with every item under a `#[cfg(test)]` attribute blanked too: the test
/// modules and test-only functions do not count.
fn without_test_items(code: &str) -> String {
    let mut chars: Vec<char> = code.chars().collect();
    let text: String = chars.iter().collect();
    let mut from = 0;
    while let Some(at) = text[from..].find("#[cfg(test)]").map(|k| k + from) {
        from = at + 1;
        let start = text[..at].chars().count();
        let attr_end = start + "#[cfg(test)]".len();
        let end = match body_start(&chars, attr_end) {
            Some(open) => closing(&chars, open),
            None => (attr_end..chars.len()).find(|&k| chars[k] == ';'),
        };
        let end = end.unwrap_or(chars.len() - 1);
        for c in &mut chars[start..=end] {
            if *c != '\n' {
                *c = ' ';
            }
        }
    }
    chars.into_iter().collect()
}

/// Each named function with a body in `text` (a source file, tests left out): its name, the
/// line its `fn` is on (from 1) and its length in lines, `fn` line to closing brace.
pub fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let code: Vec<char> = without_test_items(&blank_comments_and_strings(text))
        .chars()
        .collect();
    let line_of = |at: usize| 1 + code[..at].iter().filter(|&&c| c == '\n').count();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 2 < code.len() {
        let word = code[i] == 'f' && code[i + 1] == 'n' && !is_ident(code[i + 2]);
        if !word || (i > 0 && is_ident(code[i - 1])) {
            i += 1;
            continue;
        }
        let mut j = i + 2;
        while code.get(j).is_some_and(|c| c.is_whitespace()) {
            j += 1;
        }
        let name: String = code[j..].iter().take_while(|&&c| is_ident(c)).collect();
        // `fn(` is a function pointer type, not an item.
        if name.is_empty() {
            i += 2;
            continue;
        }
        if let Some(open) = body_start(&code, j) {
            if let Some(close) = closing(&code, open) {
                let first = line_of(i);
                out.push((name, first, line_of(close) - first + 1));
            }
        }
        i = j;
    }
    out
}

#[test]
fn function_lengths_see_through_strings_comments_and_test_code() {
    let body = |n: usize| "    let x = 1;\n".repeat(n);
    let text = format!(
        "/// A doc with {{ braces.\nfn short() {{\n    let s = \"}} {{ // not a comment\";\n    \
         let r = r#\"}}\"#;\n    let c = '{{';\n    let l: &'static str = s;\n}}\n\
         pub(crate) async fn long<T: Into<u8>>(a: T) -> Result<(), [u8; 2]>\nwhere\n    \
         T: Copy,\n{{\n{}}}\n/* {{ fn hidden() {{ */\nfn takes(f: fn(u8) -> u8) -> u8 {{ f(1) }}\n\
         trait T {{\n    fn declared(&self);\n}}\n#[cfg(test)]\nmod tests {{\n    \
         fn long_test() {{\n{}    }}\n}}\n#[cfg(test)]\nfn test_helper() {{\n{}}}\n",
        body(100),
        body(200),
        body(150)
    );
    let lengths = function_lengths(&text);
    assert_eq!(
        lengths,
        vec![
            ("short".to_owned(), 2, 6),
            ("long".to_owned(), 8, 105),
            ("takes".to_owned(), 114, 1),
        ],
        "{text}"
    );
    // The blanking itself: a brace in a string or a comment is gone, the code stays.
    assert_eq!(
        blank_comments_and_strings("let s = \"{\"; // }\n").trim_end(),
        "let s =    ;"
    );
}
