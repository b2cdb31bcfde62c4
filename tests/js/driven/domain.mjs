// Domain mode through the JavaScript SDK: only E2B_DOMAIN and
// NODE_EXTRA_CA_CERTS are set, so the SDK reaches https://api.<domain> and
// https://49983-<id>.<domain> as it reaches E2B. Driven by
// tests/test_js_sdk.py, which writes /etc/hosts lines between the two steps
// (a sandbox's host name is known only after create).
import { Sandbox } from '@e2b/code-interpreter'

const [step, id] = process.argv.slice(2)
if (step === 'create') {
  const sbx = await Sandbox.create({ timeoutMs: 120_000 })
  console.log(JSON.stringify({ id: sbx.sandboxId, hosts: [sbx.getHost(49983), sbx.getHost(49999)] }))
} else {
  const sbx = await Sandbox.connect(id)
  const run = await sbx.commands.run('echo over $((40 + 2)) tls')
  await sbx.files.write('/home/user/domain.txt', 'read back over TLS')
  const code = await sbx.runCode("print('streamed'); 6 * 7")
  console.log(JSON.stringify({
    stdout: run.stdout, file: await sbx.files.read('/home/user/domain.txt'), code: [code.logs.stdout, code.text],
  }))
  await sbx.kill()
}
