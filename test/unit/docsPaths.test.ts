// Every repository path the docs and src/'s comments name exists, and every relative link in the docs
// lands on a file (and heading) that exists: files move, and prose that points at the old place misleads.
// No database: reads files only.
import { existsSync, readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { expect, it } from 'vitest';

const ROOT = resolve(import.meta.dirname, '../..');
const read = (file: string) => readFileSync(join(ROOT, file), 'utf8');

function filesUnder(dir: string, keep: (file: string) => boolean): string[] {
  return readdirSync(join(ROOT, dir), { recursive: true, encoding: 'utf8' })
    .map((f) => join(dir, f))
    .filter((f) => statSync(join(ROOT, f)).isFile() && keep(f))
    .sort();
}

const DOCS = ['README.md', ...filesUnder('docs', (f) => f.endsWith('.md')), 'deploy/README.md', ...filesUnder('examples', (f) => f.endsWith('README.md'))];
const SOURCES = filesUnder('src', (f) => /\.(ts|js|css)$/.test(f));

/** A repository path: one of the folders checked here, then path characters; not part of a longer path or URL. */
const PATH = /(?<![\w./@-])((?:src|test|scripts|docs|examples)\/[\w./*-]*)/g;

/** Directories the build or the tests create and .gitignore names: named in the docs, absent from a clone. */
const GENERATED = new Set(read('.gitignore').split('\n').map((l) => l.trim()).filter((l) => l.endsWith('/')));

interface Named {
  path: string;
  at: string;
}

/** The parts of each line of a source file that are comments (line comments, and block comments across lines). */
function commentLines(text: string): string[] {
  let inBlock = false;
  return text.split('\n').map((line) => {
    let comment = '';
    let rest = line;
    while (rest) {
      if (inBlock) {
        const end = rest.indexOf('*/');
        comment += ` ${end < 0 ? rest : rest.slice(0, end)}`;
        if (end < 0) break;
        inBlock = false;
        rest = rest.slice(end + 2);
        continue;
      }
      // `//` after a colon is a URL's (http://), not a comment.
      const lineComment = rest.search(/(?<!:)\/\//);
      const block = rest.indexOf('/*');
      if (block >= 0 && (lineComment < 0 || block < lineComment)) {
        inBlock = true;
        rest = rest.slice(block + 2);
        continue;
      }
      if (lineComment >= 0) comment += ` ${rest.slice(lineComment + 2)}`;
      break;
    }
    return comment;
  });
}

function pathsNamed(file: string, lines: string[]): Named[] {
  return lines.flatMap((line, i) =>
    [...line.matchAll(PATH)].map((m) => ({ path: m[1]!.replace(/[.*]+$/, ''), at: `${file}:${i + 1}` })),
  );
}

const missing = (named: Named[]) =>
  named.filter(({ path }) => !GENERATED.has(path) && !existsSync(join(ROOT, path))).map(({ path, at }) => `${path}  (named in ${at})`);

it('every src/, test/, scripts/, docs/ … path named in the docs exists', () => {
  const named = DOCS.flatMap((file) => pathsNamed(file, read(file).split('\n')));
  expect(named.length).toBeGreaterThan(20);
  expect(missing(named), 'paths named in the docs that do not exist').toEqual([]);
});

it("every such path named in src/'s comments exists", () => {
  const named = SOURCES.flatMap((file) => pathsNamed(file, commentLines(read(file))));
  expect(named.length).toBeGreaterThan(20);
  expect(missing(named), "paths named in src/'s comments that do not exist").toEqual([]);
});

/** GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens. */
const anchorOf = (heading: string) =>
  heading
    .trim()
    .toLowerCase()
    .replace(/[^\p{L}\p{N}\s_-]/gu, '')
    .replace(/\s/g, '-');

function anchorsOf(file: string): Set<string> {
  let inCode = false;
  const anchors = new Set<string>();
  for (const line of read(file).split('\n')) {
    if (line.startsWith('```')) inCode = !inCode;
    const heading = !inCode && line.match(/^#{1,6} (.*)$/);
    if (heading) anchors.add(anchorOf(heading[1]!));
  }
  return anchors;
}

it('every relative link in the docs lands on a file, and on a heading of it when it names one', () => {
  const broken: string[] = [];
  for (const file of DOCS) {
    read(file)
      .split('\n')
      .forEach((line, i) => {
        for (const [, target] of line.matchAll(/\]\(([^)\s]+)\)/g)) {
          if (/^[a-z]+:/.test(target!)) continue;
          const [path, anchor] = target!.split('#') as [string, string | undefined];
          const to = path ? relative(ROOT, resolve(ROOT, dirname(file), path)) : file;
          if (!existsSync(join(ROOT, to))) broken.push(`${target}  (in ${file}:${i + 1}: no ${to})`);
          else if (anchor && to.endsWith('.md') && !anchorsOf(to).has(anchor)) broken.push(`${target}  (in ${file}:${i + 1}: no heading #${anchor} in ${to})`);
        }
      });
  }
  expect(broken, 'links in the docs that land nowhere').toEqual([]);
});
