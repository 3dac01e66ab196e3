// After tsc (npm run build): every file under src/ that is not TypeScript (the console's CSS and script,
// read at run time beside the module that serves them) goes to dist/ at the same relative path, since
// tsc emits only what it compiles.
import { cpSync, readdirSync } from 'node:fs';
import path from 'node:path';

const root = path.resolve(import.meta.dirname, '..');
const files = readdirSync(path.join(root, 'src'), { recursive: true, withFileTypes: true })
  .filter((entry) => entry.isFile() && !entry.name.endsWith('.ts'))
  .map((entry) => path.relative(path.join(root, 'src'), path.join(entry.parentPath, entry.name)));
for (const file of files) cpSync(path.join(root, 'src', file), path.join(root, 'dist', file));
console.error(`copied ${files.length} asset(s) from src/ to dist/: ${files.join(', ')}`);
